"""test_step_plan.py: the planned step (offload/engine/fastpath.py) of host parameters in RAM runs
while nothing it depends on changed, and gives what the full step gives when something did.

A run whose steps may run as planned is compared, bitwise (parameters, state, step counts, the
exceptions and their messages), with the same run whose every step runs in full (row caches
dropped before each step, offload.testing.drop_row_caches, and each param group a new dict).
tests/test_engine_fastpath.py makes every change a user can make to parameters, gradients and
opt.state after warm (planned) steps; the tests here break the rules of the plan itself: each
fails if its rule is not applied.
"""
from __future__ import annotations


import pytest
import torch

import offload
from offload import testing
from offload.params.guards import SharedMemoryError
from test_step_cost import step_lines

SHAPES = [(16, 16), (300,), (8,)]


def _grad(p, k):
    gen = torch.Generator().manual_seed(100 + k)
    return (torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype)


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    for i, p in enumerate(ps):
        p.grad = _grad(p, i)
    return ps


def _run(changes, planned: bool, dtype=torch.float32, steps=4, **opts):
    """Per step ``changes[k](ps, opt)`` (where given) then one step: the outcome of each, the
    parameters and the state at the end."""
    ps = _params(dtype)
    opt = offload.AdamW(ps, lr=1e-2, threads=1, **opts)
    out = []
    for k in range(steps):
        if k in changes:
            changes[k](ps, opt)
        if not planned:   # every row and group checked (new dicts: no hyperparameters kept)
            testing.drop_row_caches(opt)
            opt.param_groups[:] = [dict(g) for g in opt.param_groups]
        before = [p.detach().clone() for p in ps]
        try:
            opt.step()
            out.append("ok")
        except Exception as e:
            out.append((type(e).__name__, str(e)))
            assert all(torch.equal(a, p.detach()) for a, p in zip(before, ps)), "a refused step"
    state = {i: {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
             for i, p in enumerate(ps) if p in opt.state}
    return out, [p.detach().clone() for p in ps], state


def _same_as_full(changes, **kw) -> list:
    a, b = _run(changes, True, **kw), _run(changes, False, **kw)
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert a[2].keys() == b[2].keys()
    for i, st in a[2].items():
        assert st.keys() == b[2][i].keys() and all(torch.equal(st[k], b[2][i][k]) for k in st)
    return a[0]


def _new_grads_and_lr(k):
    def change(ps, opt):
        for i, p in enumerate(ps):   # new gradient objects (zero_grad(set_to_none=True), backward)
            p.grad = _grad(p, 10 * k + i)
        opt.param_groups[0]["lr"] = 1e-2 / (k + 2)   # a scheduler
    return change


@pytest.mark.parametrize("moments", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_warm_steps_run_as_planned_and_as_in_full(moments, dtype):
    opts = dict(moments=moments, moments_min_size=200)
    ps = _params(dtype)
    opt = offload.AdamW(ps, lr=1e-2, **opts)
    opt.step()   # state made: its opt.state entries are recorded by the next step, which plans
    opt.step()
    plan = testing.step_plan(opt)
    assert plan is not None
    for k in range(3):
        _new_grads_and_lr(k)(ps, opt)
        opt.step()
        assert testing.step_plan(opt) is plan
    changes = {k: _new_grads_and_lr(k) for k in range(4)}
    assert _same_as_full(changes, dtype=dtype, **opts) == ["ok"] * 4


def test_no_plan_where_a_step_needs_more(tmp_path):
    ps = _params()
    ps[1].grad = None   # a parameter without a gradient: the full step
    opt = offload.AdamW(ps, lr=1e-2)
    opt.step()
    assert testing.step_plan(opt) is None
    ps[1].grad = _grad(ps[1], 1)
    opt.step()   # its state is made here, its opt.state entry recorded by the next step
    opt.step()
    assert testing.step_plan(opt) is not None
    opt.state_dict()   # what takes the engine's exclusive use drops the plan
    assert testing.step_plan(opt) is None
    disk = offload.AdamW(_params(), lr=1e-2, storage="mmap", nvme_dir=str(tmp_path))
    disk.step()
    assert testing.step_plan(disk) is None   # a tier with per-bucket I/O
    disk.close()


def test_new_gradients_then_a_refused_hyperparameter():
    # the gradients a refused planned step recorded are the ones the next step uses: the old ones
    # stay alive with other values, which a plan still pointing at them would read
    old = []

    def swap(ps, opt):
        old.extend(p.grad for p in ps)
        for i, p in enumerate(ps):
            p.grad = _grad(p, 50 + i)
        opt.param_groups[0]["lr"] = -1.0

    def scramble(ps, opt):
        for g in old:
            g.fill_(7.0)
        opt.param_groups[0]["lr"] = 1e-2
    out = _same_as_full({2: swap, 3: scramble}, steps=5)
    assert out[2][0] == "ValueError" and out[3:] == ["ok", "ok"]


def test_a_full_step_that_raised_after_recording_rows():
    # the full step records a new parameter tensor and a new gradient, then refuses the step: the
    # plan of the steps before must not run over the old tensors' addresses
    held = {}

    def change(ps, opt):
        ps[0].data = ps[0].data.clone() * 0.5
        held["g"] = ps[1].grad
        ps[1].grad = _grad(ps[1], 70)
        opt.param_groups[0]["eps"] = -1.0

    def back(ps, opt):
        held["g"].fill_(3.0)
        opt.param_groups[0]["eps"] = 1e-8
    out = _same_as_full({2: change, 3: back}, steps=5)
    assert out[2][0] == "ValueError" and out[3:] == ["ok", "ok"]


def test_a_new_aliasing_gradient_is_refused_when_the_plan_gives_up():
    # a new gradient recorded by the plan's row check, which then finds a row without a gradient:
    # the full step must still check the new gradient (another parameter's memory) against them
    ps = _params()
    ps[2] = torch.nn.Parameter(torch.randn(300))
    ps[2].grad = torch.randn(300)
    opt = offload.AdamW(ps, lr=1e-2)
    opt.step()
    opt.step()
    assert testing.step_plan(opt) is not None
    ps[1].grad = ps[2].data   # another parameter's memory, of the right shape: a plain new grad
    ps[0].grad = None
    for _ in range(2):
        with pytest.raises(SharedMemoryError, match="gradient of parameter 1 of group 0 shares"):
            opt.step()


def _set(key, value):   # value(): made for each run (the runs compared share nothing)
    return lambda ps, opt: opt.param_groups[0].__setitem__(key, value())


HYPER_CHANGES = {
    "lr tensor": {1: _set("lr", lambda: torch.tensor(1e-2)),
                  2: lambda ps, opt: opt.param_groups[0]["lr"].fill_(1e-3)},
    "betas tensors": {1: _set("betas", lambda: (torch.tensor(0.9), torch.tensor(0.99))),
                      2: lambda ps, opt: opt.param_groups[0]["betas"][1].fill_(0.5)},
    "group replaced": {2: lambda ps, opt: opt.param_groups.__setitem__(
        0, dict(opt.param_groups[0], lr=1e-3))},
    # an optimizer-wide option repeated in a group (as ZeroRedundancyOptimizer does), then changed
    "option in the group": {1: _set("moments", lambda: "fp32"),
                            2: _set("moments", lambda: "8bit")},
}


@pytest.mark.parametrize("what", list(HYPER_CHANGES))
def test_hyperparameters_are_read_again_where_they_may_have_changed(what):
    # a group's checked hyperparameters are kept while it holds the same immutable objects
    out = _same_as_full(HYPER_CHANGES[what], steps=4)
    if what == "option in the group":
        assert out[:2] == ["ok", "ok"] and out[2][0] == out[3][0] == "ValueError"
        assert "moments" in out[2][1]
    else:
        assert out == ["ok"] * 4


def test_a_planned_step_runs_few_python_lines():
    # deterministic stand-in for a timing guard of the fixed cost of a step: the Python lines of
    # offload's own code that one planned step of one tensor runs (about 200; a full step 650)
    p = torch.nn.Parameter(torch.randn(1024))
    p.grad = torch.randn(1024)
    opt = offload.AdamW([p], lr=1e-3, threads=1)
    for _ in range(3):
        opt.step()
    assert testing.step_plan(opt) is not None
    count, lines = step_lines(opt, where=lambda name: "/offload/" in name)
    assert count <= 230, lines.most_common(12)
