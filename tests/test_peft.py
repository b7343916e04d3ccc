"""offload with PEFT LoRA (tiny random Llama, CPU, no downloads): what a fine-tuning user does.

`offload.AdamW(model.parameters())` gets the frozen base weights too (as torch's AdamW does when a
script passes every parameter); they must reserve no state and never be written, while the LoRA
matrices and a `modules_to_save` head are stepped. Between steps the adapters are merged into the
base weights for an evaluation and unmerged again (PEFT writes into the frozen weights in place), and
`merge_and_unload()` at the end folds them in for good. Every state tier and parameter side must give
the host RAM path's results bitwise, and the host path torch's AdamW within float32 rounding.
"""
import warnings

import pytest
import torch

import offload
from conftest import configs
from offload.device import FakeDevice
from tiny_models import tiny_llama

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)

STEPS = 6


def lora_model(dtype):
    model = tiny_llama(layers=2).to(dtype)
    # init_lora_weights=False: B is random too, so merging changes the base weights from the first step
    lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                         modules_to_save=["lm_head"], init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, lc)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 64, (8, 1), generator=g) + torch.arange(16)) % 64


def finetune(make_opt, dtype, merge=True):
    """Losses, merged-evaluation losses, every parameter after training, the merged model's weights,
    the frozen weights before training and the optimizer's state keys."""
    model = lora_model(dtype)
    frozen0 = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = make_opt(model.parameters())
    losses, evals = [], []
    for s in range(STEPS):
        x = batch(s)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if merge and s % 2 == 1:   # evaluate with the adapters merged into the (frozen) base weights
            if hasattr(opt, "synchronize"):
                opt.synchronize()
            model.merge_adapter()
            with torch.no_grad():
                evals.append(model(input_ids=x, labels=x).loss.item())
            model.unmerge_adapter()
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    names = {id(p): n for n, p in model.named_parameters()}
    stateful = sorted(names[id(p)] for p in opt.state if len(opt.state[p]))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    after = {n: params[n] for n in frozen0}
    merged = {n: p.detach().clone() for n, p in model.merge_and_unload().named_parameters()}
    if hasattr(opt, "close"):
        opt.close()
    return dict(losses=losses, evals=evals, params=params, merged=merged, frozen0=frozen0, frozen=after,
                stateful=stateful)


def trainable_names(run):
    return sorted(set(run["params"]) - set(run["frozen0"]))


@pytest.fixture(scope="module")
def host_runs():
    return {dtype: finetune(lambda ps: offload.AdamW(ps, lr=1e-2), dtype) for dtype in (torch.float32, torch.bfloat16)}


def test_host_path_matches_torch_and_leaves_frozen_weights_alone(host_runs):
    ours = host_runs[torch.float32]
    ref = finetune(lambda ps: torch.optim.AdamW(ps, lr=1e-2), torch.float32)
    assert ours["stateful"] == ref["stateful"] == trainable_names(ref)   # frozen weights: no state
    assert any("lora_A" in n for n in ours["stateful"]) and any("modules_to_save" in n for n in ours["stateful"])
    for k in ("losses", "evals"):
        assert ours[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6)
    for n, p in ref["params"].items():
        torch.testing.assert_close(ours["params"][n], p, rtol=1e-5, atol=1e-6)
    for n, p in ref["merged"].items():
        torch.testing.assert_close(ours["merged"][n], p, rtol=1e-5, atol=1e-6)
    # (merging and unmerging is not exact in floating point: the frozen weights are compared between
    # runs here, and with their values before training in test_frozen_weights_are_never_written)


@pytest.mark.parametrize("kw", [{}, dict(moments="8bit", moments_min_size=0),
                                dict(offload_device=FakeDevice(min_delay=0.002, max_delay=0.01), bucket_mb=0.01)],
                         ids=["ram", "8bit", "fake_device"])
def test_frozen_weights_are_never_written(kw):
    run = finetune(lambda ps: offload.AdamW(ps, lr=1e-2, **kw), torch.bfloat16, merge=False)
    assert all(torch.equal(run["frozen"][n], run["frozen0"][n]) for n in run["frozen0"])
    assert all(not torch.equal(run["params"][n], run_initial(n).bfloat16()) for n in trainable_names(run))


# the setups each fine-tuned (conftest.py configs()); device parameters: weights go up after the step while PEFT
# merges into the frozen ones
SETUPS = dict(sides=("host", "fake"), tiers=("ram", "nvme", "mmap"), moments=("fp32",), schedules=("eager", "deferred"),
              cover="listed", include=[("host", "nvme", "fp32"), ("host", "mmap", "fp32"),
                                       ("fake", "ram", "fp32", "eager"), ("fake", "nvme", "fp32", "deferred")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", configs(**SETUPS))
def test_every_tier_and_side_gives_the_host_path_bitwise(tmp_path, host_runs, cfg, dtype):
    dev = dict(offload_device=FakeDevice(min_delay=0.002, max_delay=0.01)) if cfg.side == "fake" else {}
    run = finetune(lambda ps: offload.AdamW(ps, **cfg.kwargs(tmp_path, lr=1e-2, **dev)), dtype)
    host = host_runs[dtype]
    assert run["stateful"] == host["stateful"]
    assert run["losses"] == host["losses"] and run["evals"] == host["evals"]
    for k in ("params", "merged", "frozen"):
        assert all(torch.equal(run[k][n], host[k][n]) for n in host[k]), k


@pytest.mark.parametrize("moments", ["bf16", "8bit"])
def test_compressed_moments_fine_tune(tmp_path, host_runs, moments):
    host = host_runs[torch.float32]
    kw = dict(lr=1e-2, moments=moments, moments_min_size=0)
    run = finetune(lambda ps: offload.AdamW(ps, **kw), torch.float32)
    dev = finetune(lambda ps: offload.AdamW(ps, offload_device=FakeDevice(min_delay=0.002, max_delay=0.01),
                                            bucket_mb=0.01, **kw), torch.float32)
    for k in ("losses", "evals"):
        assert dev[k] == run[k]
    assert all(torch.equal(dev["merged"][n], run["merged"][n]) for n in run["merged"])
    assert run["stateful"] == host["stateful"]
    # close to fp32 moments: the update's distance from fp32 moments' is a small part of the update
    for n in trainable_names(host):
        moved = (host["params"][n] - run_initial(n)).norm()
        assert (run["params"][n] - host["params"][n]).norm() <= 0.1 * moved, n
    assert run["losses"] == pytest.approx(host["losses"], rel=2e-3)


_INITIAL = {}


def run_initial(name):
    """A trainable parameter's value before training (the model is built from a fixed seed)."""
    if not _INITIAL:
        _INITIAL.update({n: p.detach().clone() for n, p in lora_model(torch.float32).named_parameters()})
    return _INITIAL[name]
