"""test_optim_state_tensors.py: opt.state changed between steps: replaced state tensors and step counts are
used (converted and checked, in every tier), a cleared or replaced state
starts fresh as in torch, state_dict holds plain dicts.

What a user can change between steps (parameters, gradients, opt.state, the pending clip coefficient)
is either honoured as torch.optim.AdamW honours it or refused with a clear error; never a silently
stale table (issue 10, items 2-9 and 19). Modes: RAM, NVMe, mmap state, and the GPU-offload engine
through the fake device where cheap.
"""
import gc

import pytest
import torch

from conftest import configs
from optim_state_util import HOST_FP32, LR, _run_child, close, make, pair, set_grads, step_both  # noqa: F401 (a fixture)


# ----------------------------------------------------------------------------- item 6: replaced state tensors
@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])  # all of them: test_state_cleared_or_replaced_...
def test_replaced_state_tensors_are_used(make, key):
    ours, ref = pair()
    opt, topt = make(ours), torch.optim.AdamW(ref, lr=LR)
    for s in range(4):
        set_grads(ours, s)
        set_grads(ref, s)
        if s == 2:
            for o, p in ((opt, ours[0]), (topt, ref[0])):
                for k in (("exp_avg", "exp_avg_sq") if key == "all" else (key,)):
                    o.state[p][k] = torch.zeros(p.shape)
                if key == "all":
                    o.state[p]["step"] = torch.tensor(0.0)
            gc.collect()
        opt.step()
        topt.step()
    close(ours, ref)
    assert float(opt.state[ours[0]]["step"]) == float(topt.state[ref[0]]["step"])


@pytest.mark.parametrize("cfg", configs(tiers=("nvme", "mmap"), **HOST_FP32))
def test_disk_state_replaced_moment_is_used_cleared_state_starts_fresh(make, cfg):
    # the moments live in the state file: a replacement tensor is written into it, as in RAM;
    # in-place writes to the views and opt.state.clear() behave as in torch
    ours, ref = pair(n=2)
    opt, topt = make(ours, cfg), torch.optim.AdamW(ref, lr=LR)
    for s in range(2):
        step_both(opt, topt, ours, ref, s)
    for o, p in ((opt, ours[0]), (topt, ref[0])):
        o.state[p]["exp_avg"].zero_()
    for o, p in ((opt, ours[1]), (topt, ref[1])):
        o.state[p]["exp_avg"] = torch.full(p.shape, 0.01)
    step_both(opt, topt, ours, ref, 2)
    close(ours, ref)
    torch.testing.assert_close(opt.state[ours[1]]["exp_avg"], topt.state[ref[1]]["exp_avg"])
    opt.state.clear()
    topt.state.clear()
    step_both(opt, topt, ours, ref, 3)
    close(ours, ref)
    assert float(opt.state[ours[0]]["step"]) == float(topt.state[ref[0]]["step"]) == 1.0


@pytest.mark.parametrize("cfg", configs(**HOST_FP32))
def test_replaced_step_is_used(make, cfg):
    ours, ref = pair()
    opt, topt = make(ours, cfg), torch.optim.AdamW(ref, lr=LR)
    for s in range(4):
        set_grads(ours, s)
        set_grads(ref, s)
        if s == 2:
            opt.state[ours[0]]["step"] = torch.tensor(0.0)
            topt.state[ref[0]]["step"] = torch.tensor(0.0)
        opt.step()
        topt.step()
    close(ours, ref)


def test_replaced_state_is_converted_and_checked(make):
    ours, ref = pair()
    opt, topt = make(ours), torch.optim.AdamW(ref, lr=LR)
    step_both(opt, topt, ours, ref, 0)
    opt.state[ours[0]]["exp_avg"] = torch.full((5, 6), 0.01, dtype=torch.float64).t()  # fp64, non-contiguous
    topt.state[ref[0]]["exp_avg"] = torch.full((6, 5), 0.01)
    step_both(opt, topt, ours, ref, 1)
    close(ours, ref)
    opt.state[ours[0]]["exp_avg_sq"] = torch.zeros(7)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt.step()


# ----------------------------------------------------------------------------- item 9: opt.state cleared/replaced
@pytest.mark.parametrize("case", ["clear", "new_dict", "del", "empty", "replace_all"])
def test_state_cleared_or_replaced_starts_fresh_like_torch(case):
    r = _run_child(case)
    assert r.returncode == 0 and "OK" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


def test_state_dict_holds_plain_dicts(make, tmp_path):
    ours, _ = pair()
    opt = make(ours)
    set_grads(ours, 0)
    opt.step()
    sd = opt.state_dict()
    assert all(type(v) is dict for v in sd["state"].values())
    torch.save(sd, tmp_path / "sd.pt")
    loaded = torch.load(tmp_path / "sd.pt", weights_only=True)
    torch.testing.assert_close(loaded["state"][0]["exp_avg"], opt.state[ours[0]]["exp_avg"])


@pytest.mark.parametrize("cfg", configs(moments=("fp32",)), ids=lambda c: c.id)
def test_state_dict_holds_replaced_state_before_a_step(make, cfg):
    # torch's state_dict() hands out opt.state as it is: state tensors and a step count replaced
    # after the last step are what a checkpoint holds, and what a load gives back
    ours, _ = pair()
    opt = make(ours, cfg)
    for s in range(2):
        set_grads(ours, s)
        opt.step()
    p = ours[0]
    new = {k: opt.state[p][k].clone() * 1.5 for k in ("exp_avg", "exp_avg_sq")}
    new["step"] = torch.tensor(7.0)
    for k, v in new.items():
        opt.state[p][k] = v.clone()
    sd = opt.state_dict()
    for k, v in new.items():
        torch.testing.assert_close(sd["state"][0][k].cpu(), v, rtol=0, atol=0, msg=k)
    opt.load_state_dict(sd)
    for k, v in new.items():
        torch.testing.assert_close(opt.state[p][k].cpu(), v, rtol=0, atol=0, msg=k)
    opt.state[p]["step"] = torch.tensor(float("nan"))   # one the kernel cannot take: named
    with pytest.raises(ValueError, match="state 'step' of parameter 0 of group 0 is nan"):
        opt.state_dict()
    if hasattr(opt, "close"):
        opt.close()
