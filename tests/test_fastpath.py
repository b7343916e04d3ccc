"""test_fastpath.py: the optimizer's native fast-path gather (_C.collect_rows) sends a row to
"changed" (full Python revalidation) for every kind of change a user can make between steps while
the parameter's or gradient's data pointer stays the same, and keeps untouched rows "ready"."""
import weakref

import pytest
import torch

import offload
from offload import _C
from offload.optim import _ROW_FNS


def _setup(dtype=torch.float32, n=4):
    params = [torch.nn.Parameter(torch.randn(4, 4).to(dtype)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(4, 4).to(dtype)
    opt = offload.AdamW(params, lr=1e-2)
    opt.step()
    return params, opt


def _gather(opt):
    plan = opt._plans[0]
    ready, changed = _C.collect_rows(plan.params, plan.g_ref, plan.p_ptr, plan.g_ptr, plan.g_ver, plan.p_meta,
                                     plan.lowp, plan.p_ver, _ROW_FNS)
    return ready.tolist(), list(changed)


CHANGES = {
    "param t()": lambda p: setattr(p, "data", p.data.t()),
    "param prefix slice": lambda p: setattr(p, "data", p.data.view(-1)[:8].view(2, 4)),
    "param reshape": lambda p: setattr(p, "data", p.data.view(2, 8)),
    "param dtype view": lambda p: setattr(p, "data", p.data.view(torch.bfloat16)),  # fp16 -> bf16: same shape
    "grad in-place write": lambda p: p.grad.add_(1.0),
    "grad replaced": lambda p: setattr(p, "grad", p.grad.clone()),
    "grad t_()": lambda p: p.grad.t_(),
}


@pytest.mark.parametrize("kind", list(CHANGES))
def test_each_change_goes_to_changed(kind):
    params, opt = _setup(torch.float16 if kind == "param dtype view" else torch.float32)
    assert _gather(opt) == ([0, 1, 2, 3], [])
    ptr, meta = params[2].data_ptr(), (params[2].shape, params[2].stride())
    CHANGES[kind](params[2])
    if kind.startswith("param"):
        assert params[2].data_ptr() == ptr  # the case the pointer compare alone misses
    if kind == "param dtype view":
        assert (params[2].shape, params[2].stride()) == meta  # only the dtype differs
    assert _gather(opt) == ([0, 1, 3], [2])


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
    plan = opt._plans[0]
    plan.g_ref[3] = lambda: None  # "no validated gradient" stand-in (not a weakref)
    assert _gather(opt) == ([1, 2], [3])
    plan.g_ref[1] = weakref.ref(torch.zeros(1))  # dead weakref
    plan.p_meta[2] = None
    assert _gather(opt) == ([], [1, 2, 3])


def test_collect_rows_refuses_mismatched_lengths():
    params, opt = _setup()
    plan = opt._plans[0]
    with pytest.raises(ValueError, match="one entry per parameter"):
        _C.collect_rows(plan.params[:3], plan.g_ref, plan.p_ptr, plan.g_ptr, plan.g_ver, plan.p_meta,
                        plan.lowp, plan.p_ver, _ROW_FNS)
    with pytest.raises(ValueError, match="6 callables"):
        _C.collect_rows(plan.params, plan.g_ref, plan.p_ptr, plan.g_ptr, plan.g_ver, plan.p_meta,
                        plan.lowp, plan.p_ver, _ROW_FNS[:5])


def test_collect_rows_survives_a_callback_that_shrinks_the_lists():
    params, opt = _setup()
    plan = opt._plans[0]
    plist, refs, metas = list(plan.params), list(plan.g_ref), list(plan.p_meta)
    calls = []

    def data_ptr(t):
        if not calls:
            del plist[1:], refs[1:], metas[1:]
        calls.append(1)
        return torch._C.TensorBase.data_ptr(t)
    fns = (_ROW_FNS[0], data_ptr) + _ROW_FNS[2:]
    with pytest.raises(RuntimeError, match="changed size"):
        _C.collect_rows(plist, refs, plan.p_ptr, plan.g_ptr, plan.g_ver, metas, plan.lowp, plan.p_ver, fns)
