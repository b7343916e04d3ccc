"""offload inside PyTorch Lightning (``lightning.Trainer``, CPU, a tiny random model, no downloads).

Lightning steps through a closure (``optimizer.step(closure)``: forward and backward inside step),
clips inside that closure (``gradient_clip_val``), steps LR schedulers per step, saves and restores
the optimizer's ``state_dict`` in its checkpoints, and at setup moves every state tensor to the
model's device (``v[key] = v[key].to(device)``): compressed moments refused that assignment (so
moments="8bit" could not train under Lightning at all), and on a GPU the engine's host views would
have been replaced by device copies (refused at the next step). Now compressed moments take an
assignment of their own decoded values as a no-op, and the engine puts its view back in place of a
copy on another device that holds exactly its values: the state stays in its tier.
"""
import logging
import warnings

import pytest
import torch

import offload
from offload.device import CpuDevice, FakeDevice

L = pytest.importorskip("lightning")

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)


class Net(L.LightningModule):
    def __init__(self, make_opt):
        super().__init__()
        self.make_opt = make_opt
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = self.make_opt(self.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def fit(make_opt, steps=6, save=None, resume=None, **trainer_kw):
    torch.manual_seed(0)
    model = Net(make_opt)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, **trainer_kw)
        trainer.fit(model, loader(), ckpt_path=resume)
        if save is not None:
            trainer.save_checkpoint(save)
    for opt in trainer.optimizers:
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        if hasattr(opt, "close"):
            opt.close()
    return [p.detach().clone() for p in model.parameters()]


def configs(tmp_path):
    return {
        "ram": lambda ps: offload.AdamW(ps, lr=1e-2),
        "nvme": lambda ps: offload.AdamW(ps, lr=1e-2, storage="nvme", nvme_dir=tmp_path),
        "8bit": lambda ps: offload.AdamW(ps, lr=1e-2, moments="8bit", moments_min_size=0),
        "cpu_device_deferred": lambda ps: offload.AdamW(ps, lr=1e-2, offload_device=CpuDevice(), bucket_mb=0.001,
                                                        step_during_backward=False),
        "fake_device_eager": lambda ps: offload.AdamW(ps, lr=1e-2, offload_device=FakeDevice(max_delay=0.002),
                                                      bucket_mb=0.001),
    }


def torch_adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2)


def close(name, got, ref):
    tol = dict(rtol=2e-2, atol=2e-3) if name == "8bit" else {}   # 8bit: a few steps of quantized moments
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["ram", "nvme", "8bit", "cpu_device_deferred", "fake_device_eager"])
def test_trainer_fit_gives_torch_result(tmp_path, name):
    close(name, fit(configs(tmp_path)[name]), fit(torch_adamw))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["ram", "8bit", "cpu_device_deferred"])
def test_trainer_gradient_clipping_gives_torch_result(tmp_path, name):
    close(name, fit(configs(tmp_path)[name], gradient_clip_val=0.05), fit(torch_adamw, gradient_clip_val=0.05))


@pytest.mark.timeout(120)
def test_trainer_gradient_clipping_with_buckets_stepped_during_backward_is_refused(tmp_path):
    """Lightning clips after backward, when those buckets were already stepped: a named error saying
    what to pass instead, not a step with unclipped gradients."""
    with pytest.raises(RuntimeError, match="max_grad_norm|step_during_backward=False"):
        fit(configs(tmp_path)["fake_device_eager"], gradient_clip_val=0.05)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["nvme", "8bit", "cpu_device_deferred"])
def test_trainer_checkpoint_resume_matches_torch(tmp_path, name):
    """4 steps, Trainer.save_checkpoint, a new Trainer resumes to 8: the same as torch.optim.AdamW through
    the same save and resume (Lightning's resume itself is not the uninterrupted run: it restarts the
    epoch's data)."""
    make = configs(tmp_path)[name]
    fit(make, steps=4, save=tmp_path / "ours.ckpt")
    fit(torch_adamw, steps=4, save=tmp_path / "torch.ckpt")
    close(name, fit(make, steps=8, resume=tmp_path / "ours.ckpt"), fit(torch_adamw, steps=8, resume=tmp_path / "torch.ckpt"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["nvme", "8bit", "cpu_device_deferred"])
def test_state_moved_to_a_device_stays_in_its_tier(tmp_path, name, monkeypatch):
    """What Lightning's _optimizer_to_device does on a GPU (every entry but 'step' replaced by a copy on
    the model's device), simulated with CPU copies that the engine is told are on another device:
    accepted, and the run is bitwise the one without it; a replacement with other values is taken
    over (fp32 moments) or refused by name (compressed moments: use load_state_dict)."""
    from lightning.fabric.utilities import optimizer as fopt
    from offload.engine import torchstate
    monkeypatch.setattr(torchstate, "_on_another_device", lambda t, cur: True)

    def run(move):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        opt = configs(tmp_path)[name](model.parameters())
        gen = torch.Generator().manual_seed(1)
        for s in range(4):
            model(torch.randn(8, 16, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if s == 1 and move:
                if hasattr(opt, "synchronize"):
                    opt.synchronize()
                monkeypatch.setattr(fopt, "move_data_to_device", lambda t, device: t.clone())
                fopt._optimizer_to_device(opt, "cpu")
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        out = [p.detach().clone() for p in model.parameters()]
        return out, opt
    ref, o1 = run(False)
    got, opt = run(True)
    o1.close()
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    p = next(iter(opt.state))
    if name != "8bit":   # fp32 moments, RAM or disk: other values are taken over, as in torch
        want = opt.state[p]["exp_avg"] * 2
        opt.state[p]["exp_avg"] = new = want.clone()
        opt.step()   # (no gradients: nothing is stepped; the values are copied into the tier, its view put back)
        opt.synchronize()
        assert opt.state[p]["exp_avg"] is not new and torch.equal(opt.state[p]["exp_avg"], want)
        opt.close()
        return
    with pytest.raises(ValueError, match="replaced|cannot be replaced"):
        opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"] * 2
        opt.step()   # (the engine's fp32 views are checked at the next step)
    opt.close()
