# test_optim_state.py: what a user can change between steps (parameters, gradients, opt.state, the
# pending clip coefficient) is either honoured as torch.optim.AdamW honours it or refused with a
# clear error; never a silently stale table (issue 10, items 2-9 and 19). Modes: RAM, NVMe, mmap
# state, and the GPU-offload engine through the fake device where cheap.
import gc
import subprocess
import sys
import textwrap
import weakref
from collections import defaultdict

import pytest
import torch

import offload
from conftest import Config, configs

HOST_FP32 = dict(sides=("host",), moments=("fp32",))   # configs(...) of this file: the tiers vary
LR = 1e-2


@pytest.fixture
def make(make_opt):
    """make(params, cfg, **kw) -> make_opt's offload.AdamW of that configuration (host RAM by default)."""
    return lambda params, cfg=Config(), **kw: make_opt(cfg, params, **dict(dict(lr=LR), **kw))


def pair(shape=(6, 5), dtype=torch.float32, seed=0, n=1):
    """n parameters for offload and a torch copy of each (fp32)."""
    torch.manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for _ in range(n)]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    return ours, ref


def set_grads(ps, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


def close(a, b, **kw):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach().float(), y.detach().float(), **kw)


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
    set_grads(ours, 2)
    set_grads(ref, 2)
    opt.step()
    topt.step()
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
        set_grads(ours, s)
        set_grads(ref, s)
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
def test_disk_state_replaced_moment_is_refused_cleared_state_starts_fresh(make, cfg):
    # the moments live in the state file: a replacement tensor is refused by name (never ignored);
    # in-place writes to the views and opt.state.clear() behave as in torch
    ours, ref = pair()
    opt, topt = make(ours, cfg), torch.optim.AdamW(ref, lr=LR)
    for s in range(2):
        set_grads(ours, s)
        set_grads(ref, s)
        opt.step()
        topt.step()
    for o, p in ((opt, ours[0]), (topt, ref[0])):
        o.state[p]["exp_avg"].zero_()
    saved = opt.state[ours[0]]["exp_avg"]
    opt.state[ours[0]]["exp_avg"] = torch.zeros(ours[0].shape)
    with pytest.raises(ValueError, match="exp_avg.*replaced by another tensor"):
        opt.step()
    opt.state[ours[0]]["exp_avg"] = saved
    for o, ps in ((opt, ours), (topt, ref)):
        set_grads(ps, 2)
        o.step()
    close(ours, ref)
    opt.state.clear()
    topt.state.clear()
    for o, ps in ((opt, ours), (topt, ref)):
        set_grads(ps, 3)
        o.step()
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
    set_grads(ours, 0)
    set_grads(ref, 0)
    opt.step()
    topt.step()
    opt.state[ours[0]]["exp_avg"] = torch.full((5, 6), 0.01, dtype=torch.float64).t()  # fp64, non-contiguous
    topt.state[ref[0]]["exp_avg"] = torch.full((6, 5), 0.01)
    set_grads(ours, 1)
    set_grads(ref, 1)
    opt.step()
    topt.step()
    close(ours, ref)
    opt.state[ours[0]]["exp_avg_sq"] = torch.zeros(7)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt.step()


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
    set_grads(ours, 0)
    set_grads(ref, 0)
    opt.step()
    topt.step()
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
    set_grads(ours, 0)
    set_grads(ref, 0)
    opt.step()
    topt.step()
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


# crash-prone cases run in a child process: before the fixes they wrote or read freed memory
CHILD = textwrap.dedent("""
    import sys, torch, offload
    from collections import defaultdict
    case = sys.argv[1]
    ps = [torch.nn.Parameter(torch.randn(1 << 16)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, topt = offload.AdamW(ps, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
    def grads(s):  # new gradients at first, then written in place (as zero_grad(set_to_none=False) does)
        for a, b in zip(ps, ref):
            g = torch.randn(a.shape, generator=torch.Generator().manual_seed(s))
            if a.grad is None or s == 0:
                a.grad, b.grad = g.clone(), g.clone()
            else:
                a.grad.copy_(g)
                b.grad.copy_(g)
    grads(0); opt.step(); topt.step()
    if case == "param_storage":
        ps[0].untyped_storage().resize_(16)
    elif case == "grad_storage":
        grads(1); ps[0].grad.untyped_storage().resize_(16)
    if case in ("param_storage", "grad_storage"):
        grads(1) if case == "param_storage" else None
        try:
            opt.step()
        except RuntimeError as e:
            assert "storage" in str(e), e
            print("REFUSED"); sys.exit(0)
        print("STEPPED"); sys.exit(1)
    for o, t in ((opt, ps), (topt, ref)):
        if case == "clear":
            o.state.clear()
        elif case == "new_dict":
            o.state = defaultdict(dict)
        elif case == "del":
            del o.state[t[1]]
        elif case == "empty":
            o.state[t[2]] = {}
        elif case == "replace_all":
            for p in t:
                o.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(p.shape), "exp_avg_sq": torch.zeros(p.shape)}
    import gc; gc.collect()
    for s in range(1, 4):
        grads(s); opt.step(); topt.step()
    for a, b in zip(ps, ref):
        torch.testing.assert_close(a.detach(), b.detach())
    print("OK")
""")


def _run_child(case):
    return subprocess.run([sys.executable, "-c", CHILD, case], capture_output=True, text=True, timeout=120)


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


@pytest.mark.parametrize("moments", ["fp32", "bf16"])   # fp32: the host-RAM fast path; bf16: the engine
def test_shared_memory_is_refused_with_one_type_on_every_path(moments):
    buf = torch.zeros(8192)
    a, b = torch.nn.Parameter(buf[:4096]), torch.nn.Parameter(buf[2048:6144])   # overlapping views
    for p in (a, b):
        p.grad = torch.ones(4096)
    with pytest.raises(offload.SharedMemoryError, match="share") as e:   # at construction or at the step
        offload.AdamW([a, b], moments=moments, moments_min_size=0).step()
    assert isinstance(e.value, ValueError) and isinstance(e.value, RuntimeError)
