"""test_optim_state_params.py: parameters changed between steps: writes to bf16/fp16 parameters kept,
parameters, gradients or state sharing memory refused, transposed, shrunk or reshaped p.data and
gradients never mispaired (crash-prone cases in a child process).

What a user can change between steps (parameters, gradients, opt.state, the pending clip coefficient)
is either honoured as torch.optim.AdamW honours it or refused with a clear error; never a silently
stale table (issue 10, items 2-9 and 19). Modes: RAM, NVMe, mmap state, and the GPU-offload engine
through the fake device where cheap.
"""
import pytest
import torch

import offload
from conftest import configs
from optim_state_util import HOST_FP32, LR, _run_child, close, make, pair, set_grads, step_both  # noqa: F401 (a fixture)


# ----------------------------------------------------------------------------- item 3: writes to bf16/fp16 params
def _write(p, how):
    with torch.no_grad():
        if how == "mul_":
            p.mul_((torch.arange(p.numel()) % 2).view(p.shape).to(p.dtype))
        elif how == "clamp_":
            p.clamp_(-0.25, 0.25)
        elif how == "copy_":
            p.copy_(torch.full(p.shape, 0.375))
        elif how == "load_state_dict":
            m = torch.nn.Module()
            m.w = p
            m.load_state_dict({"w": torch.full(p.shape, -0.625)})
        elif how == "data":
            p.data = torch.full(p.shape, 0.125, dtype=p.dtype)


@pytest.mark.parametrize("cfg", configs(**HOST_FP32))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["mul_", "clamp_", "copy_", "load_state_dict", "data"])
def test_write_to_low_precision_param_between_steps_is_kept(make, cfg, dtype, how):
    ours, _ = pair(dtype=dtype)
    p = ours[0]
    opt = make(ours, cfg, lr=0.0, weight_decay=0.0)  # lr 0: a step must leave p as the user wrote it
    set_grads(ours, 1)
    opt.step()
    _write(p, how)
    written = p.detach().clone()
    set_grads(ours, 2)
    opt.step()
    assert torch.equal(p.detach(), written)


def test_identical_write_keeps_fp32_master_precision(make):
    ours, _ = pair(dtype=torch.bfloat16)
    p = ours[0]
    opt = make(ours, weight_decay=0.0)
    set_grads(ours, 1)
    opt.step()
    master = opt.state[p]["master_param"].clone()
    assert not torch.equal(master, master.to(torch.bfloat16).float())  # it carries more than bf16
    keep = (torch.arange(p.numel()) % 2).view(p.shape).bool()
    with torch.no_grad():
        p.mul_(keep.to(p.dtype))  # prune half: the kept half is rewritten with identical values
    opt.param_groups[0]["lr"] = 0.0  # the step re-reads the master but does not move it
    set_grads(ours, 2)
    opt.step()
    m = opt.state[p]["master_param"]
    assert torch.equal(m[keep], master[keep])
    assert torch.equal(m[~keep], torch.zeros_like(m[~keep]))


# ----------------------------------------------------------------------------- item 4: shared storage
def test_overlapping_parameters_are_refused(make):
    base = torch.randn(40)
    a = torch.nn.Parameter(base[0:30])
    b = torch.nn.Parameter(base[20:40])
    with pytest.raises(RuntimeError, match="parameter 0 of group 1 shares memory with parameter 0 of group 0"):
        make([{"params": [a]}, {"params": [b]}])   # refused when the state is laid out, before any step


def test_gradient_aliasing_a_parameter_is_refused(make):
    ours, _ = pair(n=2)
    opt = make(ours)
    set_grads(ours, 1)
    opt.step()
    ours[1].grad = ours[0].detach()  # reads what the step writes
    with pytest.raises(RuntimeError, match="gradient of parameter 1 of group 0 shares memory with parameter 0"):
        opt.step()


def test_state_aliasing_a_parameter_is_refused(make):
    ours, _ = pair(n=2)
    opt = make(ours)
    set_grads(ours, 1)
    opt.step()
    opt.state[ours[1]]["exp_avg"] = ours[0].detach()
    with pytest.raises(RuntimeError, match="'exp_avg' shares memory with parameter 0 of group 0"):
        opt.step()


def test_disjoint_views_of_one_storage_are_fine(make):
    base = torch.randn(40)
    ours = [torch.nn.Parameter(base[0:20]), torch.nn.Parameter(base[20:40])]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt, topt = make(ours), torch.optim.AdamW(ref, lr=LR)
    for s in range(3):
        step_both(opt, topt, ours, ref, s)
    close(ours, ref)


@pytest.mark.parametrize("moments", ["fp32", "bf16"])   # fp32: the host-RAM fast path; bf16: the engine
def test_shared_memory_is_refused_with_one_type_on_every_path(moments):
    buf = torch.zeros(8192)
    a, b = torch.nn.Parameter(buf[:4096]), torch.nn.Parameter(buf[2048:6144])   # overlapping views
    for p in (a, b):
        p.grad = torch.ones(4096)
    with pytest.raises(offload.SharedMemoryError, match="share") as e:   # at construction or at the step
        offload.AdamW([a, b], moments=moments, moments_min_size=0).step()
    assert isinstance(e.value, ValueError) and isinstance(e.value, RuntimeError)


# ----------------------------------------------------------------------------- items 7, 10: changed params/grads
def _step_or_refuse(opt, topt, match):
    """The step must either give torch's answer or raise an error naming the problem."""
    try:
        opt.step()
    except RuntimeError as e:
        assert match in str(e)
        return False
    topt.step()
    return True


@pytest.mark.parametrize("static_grad", [False, True])
def test_transposed_param_data_is_not_mispaired(make, static_grad):
    ours, ref = pair(shape=(5, 5))
    opt, topt = make(ours), torch.optim.AdamW(ref, lr=LR)
    step_both(opt, topt, ours, ref, 0)
    for p in ours + ref:
        p.data = p.data.t()
    if not static_grad:
        set_grads(ours, 1)
        set_grads(ref, 1)
    if _step_or_refuse(opt, topt, "contiguous"):
        close(ours, ref)


def test_transposed_grad_in_place_is_not_mispaired(make):
    ours, ref = pair(shape=(5, 5))
    opt, topt = make(ours), torch.optim.AdamW(ref, lr=LR)
    step_both(opt, topt, ours, ref, 0)
    for p in ours + ref:
        p.grad.t_()  # same object and data pointer, new strides
    if _step_or_refuse(opt, topt, "contiguous"):
        close(ours, ref)


def test_shrunk_param_data_with_same_pointer_is_refused(make):
    p = torch.nn.Parameter(torch.randn(1000))
    opt = make([p])
    set_grads([p], 0)
    opt.step()
    p.data = p.data[:10]
    set_grads([p], 1)
    with pytest.raises(RuntimeError, match="changed size"):
        opt.step()


@pytest.mark.parametrize("case", ["param_storage", "grad_storage"])
def test_shrunk_storage_is_refused_not_crashed(case):
    r = _run_child(case)
    assert r.returncode == 0 and "REFUSED" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("what", ["exp_avg", "step"])
def test_state_storage_the_kernel_writes_cannot_be_freed(make, what):
    ours, _ = pair()
    opt = make(ours)
    set_grads(ours, 0)
    opt.step()
    with pytest.raises(RuntimeError, match="not resizable"):
        opt.state[ours[0]][what].untyped_storage().resize_(0)


# ----------------------------------------------------------------------------- item 8: reshaped p.data
def test_reshaped_param_state_follows_and_loads_back(make):
    ours, ref = pair(shape=(6, 5))
    opt, topt = make(ours), torch.optim.AdamW(ref, lr=LR)
    for s in range(3):  # the torch copy keeps the old shape (torch itself fails on a reshaped parameter)
        if s == 1:
            for p in ours:
                p.data = p.data.reshape(3, 10)
        set_grads(ref, s)
        for p, r in zip(ours, ref):
            p.grad = r.grad.reshape(3, 10) if s else r.grad.clone()
        opt.step()
        topt.step()
    assert opt.state[ours[0]]["exp_avg"].shape == (3, 10)
    fresh = make(ours)
    fresh.load_state_dict(opt.state_dict())  # the saved state has the parameter's current shape
    set_grads(ref, 3)
    for p, r in zip(ours, ref):
        p.grad = r.grad.reshape(3, 10)
    fresh.step()
    topt.step()
    close([p.reshape(6, 5) for p in ours], ref)
