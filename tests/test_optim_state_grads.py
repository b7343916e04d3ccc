"""test_optim_state_grads.py: gradients and the pending clip coefficient between steps: the coefficient
is discarded by zero_grad and by skipped steps, gradients modified after the clip are refused, a second
clip clips what the first left; a failed step advances no step count; no gradient is kept alive.

What a user can change between steps (parameters, gradients, opt.state, the pending clip coefficient)
is either honoured as torch.optim.AdamW honours it or refused with a clear error; never a silently
stale table (issue 10, items 2-9 and 19). Modes: RAM, NVMe, mmap state, and the GPU-offload engine
through the fake device where cheap.
"""
import gc
import weakref

import pytest
import torch

from conftest import configs
from optim_state_util import HOST_FP32, LR, close, make, pair, set_grads, step_both  # noqa: F401 (a fixture)


# ----------------------------------------------------------------------------- item 2: clip coefficient
@pytest.mark.parametrize("cfg", configs(**HOST_FP32))
@pytest.mark.parametrize("set_to_none", [True, False])
def test_clip_coefficient_discarded_by_zero_grad(make, cfg, set_to_none):
    ours, ref = pair()  # eps=0.1: Adam is not invariant to the gradient scale, so a stale coefficient shows
    opt, topt = make(ours, cfg, eps=0.1), torch.optim.AdamW(ref, lr=LR, eps=0.1)
    set_grads(ours, 1, scale=100.0)
    set_grads(ref, 1, scale=100.0)
    opt.clip_grad_norm_(1.0)  # the batch is skipped: no step
    opt.zero_grad(set_to_none=set_to_none)
    topt.zero_grad(set_to_none=set_to_none)
    for ps in (ours, ref):
        if set_to_none:
            set_grads(ps, 2)
        else:
            for p, g in zip(ps, (torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) for p in ps)):
                p.grad.add_(g)
    opt.step()
    topt.step()
    close(ours, ref)


@pytest.mark.parametrize("cfg", configs(sides=("host", "fake"), tiers=("ram",), moments=("fp32",),
                                        schedules=("deferred",)))
def test_clip_coefficient_discarded_by_zero_grad_with_backward(make, cfg):
    torch.manual_seed(0)
    model, ref_model = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ref_model.load_state_dict(model.state_dict())
    opt, topt = make(model.parameters(), cfg), torch.optim.AdamW(ref_model.parameters(), lr=LR)
    x = torch.randn(8, 4)
    (model(x).pow(2).sum() * 1e3).backward()
    opt.clip_grad_norm_(1e-3)  # the batch is skipped
    opt.zero_grad()
    for m, o in ((model, opt), (ref_model, topt)):
        m(x).pow(2).sum().backward()
        o.step()
    if cfg.device:
        opt.synchronize()  # GPU mode uploads the new weights asynchronously (the next forward waits for them)
    close(model.parameters(), ref_model.parameters())


@pytest.mark.parametrize("cfg", configs(**HOST_FP32))
def test_clip_coefficient_of_a_skipped_step_is_not_applied_to_new_gradients(make, cfg):
    # GradScaler found inf: the norm is inf, the coefficient 0, and opt.step() is never called; the
    # next batch's gradients are new tensors (model.zero_grad() / p.grad = None, not opt.zero_grad()).
    ours, ref = pair()
    opt, topt = make(ours, cfg, eps=0.1), torch.optim.AdamW(ref, lr=LR, eps=0.1)
    set_grads(ours, 1)
    ours[0].grad[0, 0] = float("inf")
    assert not torch.isfinite(opt.clip_grad_norm_(1.0))
    for p in ours:
        p.grad = None
    step_both(opt, topt, ours, ref, 2)
    close(ours, ref)
    assert torch.isfinite(ours[0]).all()


def test_clip_coefficient_of_a_step_grad_scaler_skipped(make):
    # the loop GradScaler runs: inf gradients -> no opt.step(); the next batch starts with module.zero_grad()
    model = torch.nn.Linear(4, 3)
    ref_model = torch.nn.Linear(4, 3)
    ref_model.load_state_dict(model.state_dict())
    opt = make(model.parameters(), eps=0.1)
    topt = torch.optim.AdamW(ref_model.parameters(), lr=LR, eps=0.1)
    x = torch.randn(8, 4)
    for it in range(3):
        for m, o in ((model, opt), (ref_model, topt)):
            m.zero_grad()  # the module's zero_grad (set_to_none): the optimizer is not told
            loss = m(x).pow(2).sum() * (1e38 if it == 0 else 1.0)  # overflows: inf (not NaN) gradients
            loss.backward()
        if it == 0:
            assert not torch.isfinite(opt.clip_grad_norm_(1.0))  # GradScaler would skip this step
            continue
        opt.clip_grad_norm_(1e-3)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e-3)
        opt.step()
        topt.step()
    close(model.parameters(), ref_model.parameters())


@pytest.mark.parametrize("cfg", configs(**HOST_FP32))
def test_gradients_modified_after_clip_raise(make, cfg):
    ours, _ = pair()
    opt = make(ours, cfg)
    set_grads(ours, 1, scale=100.0)
    opt.clip_grad_norm_(1.0)
    ours[0].grad.add_(1.0)  # another backward accumulating: torch would add onto clipped values
    with pytest.raises(RuntimeError, match="after clip_grad_norm_"):
        opt.step()
    opt.zero_grad()
    set_grads(ours, 2)
    opt.step()  # zero_grad discarded the coefficient


def test_clip_twice_clips_what_the_first_call_left(make):
    ours, ref = pair()
    opt, topt = make(ours), torch.optim.AdamW(ref, lr=LR)
    set_grads(ours, 1, scale=10.0)
    set_grads(ref, 1, scale=10.0)
    n1 = opt.clip_grad_norm_(1.0)
    n2 = opt.clip_grad_norm_(0.5)
    t1 = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    t2 = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    torch.testing.assert_close((n1, n2), (t1, t2))
    opt.step()
    topt.step()
    close(ours, ref)


# ----------------------------------------------------------------------------- item 5: all-or-nothing step
@pytest.mark.parametrize("cfg", configs(**HOST_FP32))
def test_failed_step_advances_no_step_count(make, cfg):
    ours, ref = pair(n=2)
    opt = make([{"params": [ours[0]]}, {"params": [ours[1]]}], cfg)
    topt = torch.optim.AdamW([{"params": [ref[0]]}, {"params": [ref[1]]}], lr=LR)
    for s in range(2):
        set_grads(ours, s)
        set_grads(ref, s)
        if s == 1:
            opt.param_groups[1]["lr"] = -1.0
            with pytest.raises(ValueError, match="learning rate"):
                opt.step()
            opt.param_groups[1]["lr"] = LR
        opt.step()
        topt.step()
    close(ours, ref)
    assert [float(opt.state[p]["step"]) for p in ours] == [2.0, 2.0]


# ----------------------------------------------------------------------------- item 19: no grad references kept
@pytest.mark.parametrize("how", ["opt.zero_grad", "p.grad = None"])
def test_gradients_are_not_kept_alive(make, how):
    ours, _ = pair(n=2)
    opt = make(ours)
    set_grads(ours, 0)
    opt.step()
    opt.clip_grad_norm_(1e-3)
    refs = [weakref.ref(p.grad) for p in ours]
    if how == "opt.zero_grad":
        opt.zero_grad(set_to_none=True)
    else:
        for p in ours:
            p.grad = None
    gc.collect()
    assert all(r() is None for r in refs)
