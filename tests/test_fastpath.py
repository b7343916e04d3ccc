"""test_fastpath.py: the optimizer's native per-step row check (_C.collect_rows, csrc/rows.cpp) sends a
row to "changed" (full Python revalidation) for every kind of change a user can make between steps
while the parameter's or gradient's object and data pointer stay the same (``t.data = ...`` keeps
even the version counter), validates a new plain gradient natively ("newgrad") exactly as the Python
path would, and keeps untouched rows "ready"."""
import weakref

import numpy as np
import pytest
import torch

import offload
from offload import _C, testing
from offload.native.rows import M_PPTR, ROW_FNS


def _setup(dtype=torch.float32, n=4, shape=(4, 4)):
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(shape).to(dtype)
    opt = offload.AdamW(params, lr=1e-2)
    opt.step()
    return params, opt


def _gather(opt, full=False):
    plan = testing.row_records(opt)[0]
    r = _C.collect_rows(plan.params, plan.g_ref, plan.meta, plan.layouts, plan.table, ROW_FNS)
    r = tuple(x.tolist() for x in r)
    return r if full else (r[0], r[2])  # (ready, changed); full: (ready, newgrad, changed, other)


def _setdata(f):
    return lambda t: setattr(t, "data", f(t.data))


CHANGES = {  # each keeps the object and the data pointer (and, for `.data =`, the version counter)
    "param t()": lambda p: setattr(p, "data", p.data.t()),
    "param prefix slice": lambda p: setattr(p, "data", p.data.view(-1)[:8].view(2, 4)),
    "param reshape": lambda p: setattr(p, "data", p.data.view(2, 8)),
    "param unsqueeze": lambda p: setattr(p, "data", p.data.unsqueeze(0)),
    "param dtype view": lambda p: setattr(p, "data", p.data.view(torch.bfloat16)),  # fp16 -> bf16: same shape
    "param neg view": lambda p: setattr(p, "data", torch._neg_view(p.data)),
    "grad t_()": lambda p: p.grad.t_(),
    "grad .data t()": lambda p: _setdata(lambda d: d.t())(p.grad),
    "grad .data prefix": lambda p: _setdata(lambda d: d.view(-1)[:8].view(2, 4))(p.grad),
    "grad .data reshape": lambda p: _setdata(lambda d: d.view(2, 8))(p.grad),
    "grad .data int32 view": lambda p: _setdata(lambda d: d.view(torch.int32))(p.grad),
    "grad .data neg view": lambda p: _setdata(torch._neg_view)(p.grad),
}


@pytest.mark.parametrize("kind", list(CHANGES))
def test_each_change_goes_to_changed(kind):
    params, opt = _setup(torch.float16 if kind == "param dtype view" else torch.float32)
    assert _gather(opt) == ([0, 1, 2, 3], [])
    t = params[2] if kind.startswith("param") else params[2].grad
    ptr, obj = t.data_ptr(), t
    CHANGES[kind](params[2])
    now = params[2] if kind.startswith("param") else params[2].grad
    assert now is obj and now.data_ptr() == ptr  # the case the object and pointer compares alone miss
    assert _gather(opt) == ([0, 1, 3], [2])


GRAD_DATA = {k: v for k, v in CHANGES.items() if k.startswith("grad .data")}


@pytest.mark.parametrize("kind", list(GRAD_DATA))
def test_grad_data_replaced_in_place_is_refused_not_stepped(kind):
    # Before the native check compared the grad's strides, shape, dtype and neg bit, these stepped
    # silently (a transposed or negated gradient applied as is; shapes torch refuses accepted).
    params, opt = _setup(n=2)
    GRAD_DATA[kind](params[1])
    before = [p.detach().clone() for p in params]
    with pytest.raises((RuntimeError, TypeError), match="gradient of parameter 1"):
        opt.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, params))  # a step that raises changes nothing


def test_neg_view_param_is_refused():
    p = torch.nn.Parameter(torch.randn(4, 4))
    p.data = torch._neg_view(torch.randn(4, 4))  # contiguous, with the neg bit: its memory holds -values
    assert p.is_neg()
    p.grad = torch.ones(4, 4)
    with pytest.raises(RuntimeError, match="negative-bit"):
        offload.AdamW([p]).step()


def test_grad_written_in_place_stays_ready_and_matches_torch():
    # zero_grad(set_to_none=False) + backward: same grad objects, new values; no revalidation needed
    init = [torch.randn(4, 4) for _ in range(3)]
    params = [torch.nn.Parameter(x.clone()) for x in init]
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    opt, topt = offload.AdamW(params, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
    for s in range(4):
        for k, (a, b) in enumerate(zip(params, ref)):
            g = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * s + k))
            if s == 0:
                a.grad, b.grad = g.clone(), g.clone()
            else:
                a.grad.copy_(g)
                b.grad.copy_(g)
        if s:
            assert _gather(opt) == ([0, 1, 2], [])
        opt.step()
        topt.step()
    for a, b in zip(params, ref):
        torch.testing.assert_close(a.detach(), b.detach())


def test_new_grads_are_validated_natively_and_step_like_torch():
    params, opt = _setup(n=3)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    topt = torch.optim.AdamW(ref, lr=1e-2)
    for r, p in zip(ref, params):  # give torch the same state: one step taken with these grads
        r.grad = p.grad.clone()
    topt.step()
    for a, p in zip(ref, params):
        a.data.copy_(p.detach())
    for s in range(3):
        for k, (a, b) in enumerate(zip(params, ref)):
            g = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * s + k))
            a.grad, b.grad = g.clone(), g.clone()
        assert _gather(opt, full=True) == ([], [0, 1, 2], [], [])  # all new, validated here
        assert _gather(opt) == ([0, 1, 2], [])  # recorded
        for a in params:  # collect_rows recorded them; the step must still see them as the grads
            a.grad = a.grad.clone()
        opt.step()
        topt.step()
    for a, b in zip(params, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def _shrunk(t):
    t.untyped_storage().resize_(8)
    return t


BAD_GRADS = {  # (new grad, what the Python path's message says)
    "dtype": (lambda: torch.randn(4, 4, dtype=torch.float64), "dtype"),
    "shape": (lambda: torch.randn(2, 8), "shape"),
    "non-contiguous": (lambda: torch.randn(4, 4).t(), "not contiguous"),
    "neg view": (lambda: torch._neg_view(torch.randn(4, 4)), "negative-bit"),
    "shrunk storage": (lambda: _shrunk(torch.randn(4, 4)), "storage"),
    "offset past storage": (lambda: torch.randn(40)[30:].as_strided((4, 4), (4, 1), 0), None),
}


@pytest.mark.parametrize("kind", list(BAD_GRADS))
def test_bad_new_grad_goes_to_python_and_is_refused(kind):
    params, opt = _setup(n=2)
    make, match = BAD_GRADS[kind]
    g = make()
    if kind == "offset past storage":  # a valid view at the end of its storage: accepted by both paths
        params[1].grad = g
        assert _gather(opt, full=True)[1] == [1]
        opt.step()
        return
    try:
        params[1].grad = g
    except RuntimeError:  # torch's setter refuses a shape/dtype mismatch: bypass it as `.data` allows
        params[1].grad = torch.zeros(4, 4)
        params[1].grad.data = g
    assert _gather(opt, full=True)[2] == [1]
    before = [p.detach().clone() for p in params]
    with pytest.raises((RuntimeError, TypeError), match=match):
        opt.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, params))


def test_subclass_grad_and_param_go_to_python():
    class G(torch.Tensor):
        pass
    params, opt = _setup(n=3)
    params[0].grad = torch.randn(4, 4).as_subclass(G)
    assert _gather(opt, full=True) == ([1, 2], [], [0], [])
    class P(torch.nn.Parameter):
        pass
    q = [P(torch.randn(4)) for _ in range(2)]
    q[0].grad = torch.randn(4)
    o = offload.AdamW(q)
    o.step()
    assert _gather(o, full=True) == ([], [], [], [0, 1])
    o.step()  # the Python path steps it


def test_new_grad_overlapping_a_written_buffer_is_refused_every_time():
    # the native path validates a new grad, but it must still be checked against what the kernel
    # writes; and a step that raised must not leave it "validated" for the next step to trust
    params, opt = _setup(n=2)
    params[1].grad = params[0].detach()  # reads the buffer the kernel writes for parameter 0
    for _ in range(2):
        with pytest.raises(RuntimeError, match="shares memory with parameter 0"):
            opt.step()


def test_bf16_param_written_in_place_goes_to_changed_and_is_resynced():
    params, opt = _setup(torch.bfloat16)
    assert _gather(opt) == ([0, 1, 2, 3], [])
    with torch.no_grad():
        params[1].fill_(3.0)
    assert _gather(opt) == ([0, 2, 3], [1])
    opt.step()  # the master re-read the user's write before stepping
    assert torch.allclose(opt.state[params[1]]["master_param"], torch.full((4, 4), 3.0), atol=0.05)
    assert _gather(opt) == ([0, 1, 2, 3], [])


def test_missing_grad_dead_ref_and_no_record():
    params, opt = _setup()
    params[0].grad = None
    plan = testing.row_records(opt)[0]
    plan.g_ref[3] = lambda: None  # "no validated gradient" stand-in (not a weakref): validated anew
    assert _gather(opt, full=True) == ([1, 2], [3], [], [])
    plan.g_ref[1] = weakref.ref(torch.zeros(1))  # dead weakref
    plan.meta[2, M_PPTR] = -1  # no param record
    assert _gather(opt, full=True) == ([3], [1], [2], [])


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (0, 3)])
def test_shapes_of_every_rank_stay_ready(shape):
    params, opt = _setup(shape=shape, n=2)
    assert _gather(opt) == ([0, 1], [])
    params[0].data = params[0].data.view(shape)  # a new view, same layout: still ready
    assert _gather(opt) == ([0, 1], [])
    if len(shape) >= 1 and params[0].numel():
        params[1].data = params[1].data.view(-1) if len(shape) > 1 else params[1].data.view(-1, 1)
        assert _gather(opt) == ([0], [1])
