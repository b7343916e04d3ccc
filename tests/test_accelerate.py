"""offload inside an accelerate training loop: `Accelerator.prepare`, gradient accumulation through
`accelerator.accumulate`, `accelerator.clip_grad_norm_`, an LR scheduler, `save_state` / `load_state`.

With parameters on a device and buckets stepped during backward (the GPU-offload default), the
micro-batches that accelerate (or transformers' Trainer, through accelerate's GradientState) marks as
not the last of an accumulation only accumulate, as inside `optimizer.no_sync()`: the gradients go down
once, after the last micro-batch. Before, their first backward stepped the buckets and the second one
raised.
"""
import warnings

import pytest
import torch

import offload
from conftest import configs
from offload.device import FakeDevice

accelerate = pytest.importorskip("accelerate")

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)


def fake(**kw):
    return dict(offload_device=FakeDevice(min_delay=0.001, max_delay=0.005), bucket_mb=0.01, **kw)


# the setups each run through accelerate (a whole training run each): conftest.py configs()
SETUPS = dict(sides=("host", "fake"), tiers=("ram", "nvme"), moments=("fp32", "8bit"), schedules=("eager", "deferred"),
              cover="listed", include=[("host", "ram", "fp32"), ("host", "nvme", "fp32"), ("host", "ram", "8bit"),
                                       ("fake", "ram", "fp32", "deferred"), ("fake", "ram", "fp32", "eager"),
                                       ("fake", "nvme", "8bit", "eager")])


def dataset():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g))


def train(make_opt, steps, clip, ckpt=None, save_at=None, resume=False):
    """`steps` optimizer steps of 2 accumulated micro-batches; losses of the steps run and the weights."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 8))
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    dl = torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=False)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    done = 0
    if resume:
        acc.load_state(ckpt)
        done = save_at
    losses = []
    while done < steps:
        for x, y in dl:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                if clip and acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                sched.step()
                opt.zero_grad()
            if acc.sync_gradients:
                done += 1
                losses.append(loss.item())
                if done == save_at and not resume:
                    acc.save_state(ckpt)
                if done == steps:
                    break
    inner = opt.optimizer
    if hasattr(inner, "synchronize"):
        inner.synchronize()
    weights = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    if hasattr(inner, "close"):
        inner.close()
    acc.free_memory()
    return losses, weights


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cfg", configs(**SETUPS))
def test_accumulate_clip_schedule_resume(tmp_path, cfg):
    # clipping needs every gradient before any bucket is stepped: not in the eager schedules
    clip = None if cfg.schedule == "eager" else 0.5
    kw = cfg.kwargs(tmp_path, **(fake() if cfg.side == "fake" else {}))
    losses, weights = train(lambda ps: offload.AdamW(ps, lr=1e-2, **kw), 6, clip)
    ref_losses, ref_weights = train(lambda ps: torch.optim.AdamW(ps, lr=1e-2), 6, clip)
    tol = dict(rtol=2e-2, atol=2e-3) if cfg.moments == "8bit" else dict(rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(ref_losses, rel=tol["rtol"])
    for a, b in zip(weights, ref_weights):
        torch.testing.assert_close(a, b, **tol)
    ck = str(tmp_path / "ck")
    first, w_first = train(lambda ps: offload.AdamW(ps, lr=1e-2, **kw), 6, clip, ckpt=ck, save_at=4)
    second, w_second = train(lambda ps: offload.AdamW(ps, lr=1e-2, **kw), 6, clip, ckpt=ck, save_at=4, resume=True)
    assert first == losses and second == first[4:]   # (saved at an epoch boundary)
    assert all(torch.equal(a, b) for a, b in zip(w_second, w_first))


def test_device_eager_steps_once_per_accumulation_bitwise_the_host_path(tmp_path):
    host = train(lambda ps: offload.AdamW(ps, lr=1e-2, moments="8bit", moments_min_size=0), 4, None)
    dev = train(lambda ps: offload.AdamW(ps, lr=1e-2, **fake(moments="8bit", moments_min_size=0)), 4, None)
    assert dev[0] == host[0]
    assert all(torch.equal(a, b) for a, b in zip(dev[1], host[1]))


def test_accelerate_flag_is_read_from_its_gradient_state():
    from offload.schedule.frameworks import accelerate_accumulating
    from accelerate.state import GradientState
    gs = GradientState()
    was = gs.sync_gradients
    try:
        gs._set_sync_gradients(False)
        assert accelerate_accumulating()
        gs._set_sync_gradients(True)
        assert not accelerate_accumulating()
    finally:
        gs._set_sync_gradients(was)


def test_trainer_gradient_accumulation_with_device_parameters(tmp_path):
    """transformers' Trainer sets accelerate's flag itself (it does not use `accumulate`)."""
    transformers = pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments
    from tiny_models import Counting, tiny_llama
    transformers.logging.set_verbosity_error()

    def run(kw):
        model = tiny_llama()
        opt = offload.AdamW(model.parameters(), lr=3e-3, **kw)
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, max_grad_norm=0, logging_steps=1, use_cpu=True,
                                 report_to=[], save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
                                 seed=0, lr_scheduler_type="constant")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(model=model, args=args, train_dataset=Counting(64, 16), optimizers=(opt, None))
            trainer.train()
        opt.synchronize()
        out = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], out

    host = run({})
    dev = run(fake())
    assert dev[0] == host[0]
    assert all(torch.equal(a, b) for a, b in zip(dev[1], host[1]))


def test_a_flag_left_at_not_the_last_micro_batch_only_costs_overlap():
    """accelerate's flag left False (a loop that broke off mid-accumulation) while another loop steps
    without accelerate: no bucket goes during backward, step() sends them all; results unchanged."""
    from accelerate.state import GradientState

    def run(kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
        opt = offload.AdamW(model.parameters(), lr=1e-2, **kw)
        for s in range(4):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(s))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        out = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return out

    gs = GradientState()
    was = gs.sync_gradients
    host = run({})
    try:
        gs._set_sync_gradients(False)
        dev = run(fake())
    finally:
        gs._set_sync_gradients(was)
    assert all(torch.equal(a, b) for a, b in zip(dev, host))


def test_trainer_clipping_with_buckets_stepped_during_backward_is_refused_with_what_to_do(tmp_path):
    """The Trainer clips the device gradients after backward, when the eager schedule has already
    stepped them: refused (never a step with unclipped gradients passed off as clipped), naming the fix."""
    transformers = pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments
    transformers.logging.set_verbosity_error()

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))

        def forward(self, x, labels=None):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(32, generator=g), "labels": torch.randn(8, generator=g)}

    torch.manual_seed(0)
    model = Regression()
    opt = offload.AdamW(model.parameters(), lr=1e-2, **fake())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8,
                             max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="no",
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None))
        with pytest.raises(RuntimeError, match=r"max_grad_norm=0.*offload\.AdamW\(\.\.\., max_grad_norm="):
            trainer.train()
    opt.close()
