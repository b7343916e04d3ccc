# test_step_hooks.py: what torch.optim.Optimizer wraps around step() holds for offload's optimizers
# (optim/stephooks.py): global and per-optimizer pre/post hooks in torch's order with torch's arguments,
# a pre-hook's replacement arguments, its error for a bad return value, one profiler range per step
# named as torch names it, hooks run once when a subclass's own step() calls super().step(), and
# gradients off inside step() with the caller's grad mode given back after it.
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import offload


def _pair(cls_ours, cls_torch):
    out = []
    for cls in (cls_ours, cls_torch):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(6, 5))
        p.grad = torch.randn(6, 5)
        out.append((p, cls([p], lr=0.01)))
    return out


def _log_hooks(opt, log):
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: log.append(("global pre", o is opt, len(a), a[0] is o,
                                                                     sorted(k)))),
        opt.register_step_pre_hook(lambda o, a, k: log.append(("pre", o is opt, len(a), a[0] is o, sorted(k)))),
        opt.register_step_post_hook(lambda o, a, k: log.append(("post", o is opt, len(a), a[0] is o, sorted(k)))),
        register_optimizer_step_post_hook(lambda o, a, k: log.append(("global post", o is opt, len(a), a[0] is o,
                                                                      sorted(k)))),
    ]
    return handles


def _hooks_of_one_step(opt) -> list:
    """The hooks (by kind) that one opt.step() runs, global ones included."""
    log = []
    handles = _log_hooks(opt, log)
    try:
        opt.step()
    finally:
        for h in handles:
            h.remove()
    return [e[0] for e in log]


ONCE = ["global pre", "pre", "post", "global post"]


def _param():
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    return p


@pytest.mark.parametrize("names", [("Adam", "Adam"), ("AdamW", "AdamW")])
def test_hooks_run_as_torch_runs_them(names):
    (p, ours), (q, theirs) = _pair(getattr(offload, names[0]), getattr(torch.optim, names[1]))
    logs = []
    for opt in (ours, theirs):
        log = []
        handles = _log_hooks(opt, log)
        try:
            opt.step()
            opt.step(closure=None)
            opt.step(lambda: None)
        finally:
            for h in handles:
                h.remove()
        logs.append(log)
    assert logs[0] == logs[1]
    assert [e[0] for e in logs[0][:4]] == ["global pre", "pre", "post", "global post"]
    assert all(e[1] and e[3] for e in logs[0])
    torch.testing.assert_close(p, q)


def test_pre_hook_replaces_the_arguments():
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    opt = offload.AdamW([p], lr=0.1)
    calls = []

    def closure():
        calls.append(1)
        return torch.tensor(3.0)

    h = opt.register_step_pre_hook(lambda o, a, k: ((o, closure), {}))
    try:
        assert opt.step() == 3.0   # the hook's closure ran inside the step
    finally:
        h.remove()
    assert calls == [1]


def test_pre_hook_with_a_bad_return_value_raises_as_torch():
    errors = []
    for cls in (offload.AdamW, torch.optim.AdamW):
        p = torch.nn.Parameter(torch.randn(4))
        p.grad = torch.randn(4)
        opt = cls([p])
        opt.register_step_pre_hook(lambda o, a, k: "not a tuple")
        with pytest.raises(RuntimeError, match="must return None or a tuple of") as e:
            opt.step()
        errors.append(str(e.value).split("must return", 1)[1])
    assert errors[0] == errors[1]


def test_one_profiler_range_per_step_named_as_torch_names_it():
    p = torch.nn.Parameter(torch.randn(8))
    p.grad = torch.randn(8)
    opt = offload.AdamW([p])
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
        opt.step()
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.step#AdamW.step") == 2, sorted(set(names))


def test_a_subclass_step_runs_the_hooks_once():
    class Mine(offload.AdamW):
        def step(self, closure=None):
            self.seen = getattr(self, "seen", 0) + 1
            return super().step(closure)

    opt = Mine([_param()])
    assert _hooks_of_one_step(opt) == ONCE
    assert opt.seen == 1
    # and an optimizer of the base class made afterwards still runs its hooks
    base = offload.AdamW([_param()])
    log2 = []
    base.register_step_post_hook(lambda o, a, k: log2.append(o is base))
    base.step()
    assert log2 == [True]


def test_hooks_are_not_lost_under_torch_compile_disable():
    # step() is wrapped by torch.compiler.disable; the hooks go on top of it, once
    assert offload.AdamW.step.hooked and offload.Adam.step.hooked
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    opt = offload.AdamW([p])
    n = []
    opt.register_step_pre_hook(lambda o, a, k: n.append(1))
    opt.step()
    assert n == [1]


@pytest.mark.parametrize("wraps", [True, False])
def test_a_class_level_wrapper_from_elsewhere_keeps_the_hooks(wraps):
    # a profiler or framework that patches the class's step: the hooks still run, once
    import functools
    orig = offload.AdamW.step

    def outer(self, *a, **k):
        return orig(self, *a, **k)

    offload.AdamW.step = functools.wraps(orig)(outer) if wraps else outer
    try:
        assert _hooks_of_one_step(offload.AdamW([_param()])) == ONCE
    finally:
        offload.AdamW.step = orig


def test_a_wrapper_around_a_subclass_step_runs_the_hooks_once():
    import functools

    class Mine(offload.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    opt = Mine([_param()])   # torch wraps Mine.step
    inner = Mine.step
    Mine.step = functools.wraps(inner)(lambda self, *a, **k: inner(self, *a, **k))
    assert _hooks_of_one_step(opt) == ONCE


def test_step_runs_with_gradients_off_and_gives_back_the_callers_mode():
    # as torch's step wrapper: gradients off inside step() (torch's own code steps the float64
    # parameter in place, which autograd refuses on a leaf otherwise), the caller's mode after it,
    # also after a refused step
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    p.grad = torch.randn(4, dtype=torch.float64)
    opt = offload.AdamW([p], lr=1e-3)
    for mode in (True, False):
        with torch.set_grad_enabled(mode):
            opt.step()
            assert torch.is_grad_enabled() is mode
            opt.param_groups[0]["lr"] = -1.0
            with pytest.raises(ValueError, match="Invalid learning rate"):
                opt.step()
            assert torch.is_grad_enabled() is mode
            opt.param_groups[0]["lr"] = 1e-3
