"""optim/stephooks.py: what ``torch.optim.Optimizer`` wraps around every ``step()``, for offload's
optimizers.

torch wraps each optimizer class's ``step`` (``Optimizer.profile_hook_step``) in a profiler range
named ``Optimizer.step#<class>.step``, the step pre-hooks (global, then the optimizer's own), the
``_optimizer_step_code()`` marker the profiler's Python tracer looks for, and the post-hooks (the
optimizer's own, then global). :func:`hooked_step` does the same in the same order, with the same
arguments and the same error for a pre-hook's bad return value. The one difference is the range: it
is opened with torch's C++ ``_RecordFunctionFast`` where torch has it, which records the same event
for ``torch.profiler`` and costs about 50 us instead of 300 us when a long step has evicted the
caches (a steady cost of every step: the kernel streams the whole state through memory). Where
torch lacks it, or torch's CUPTI monitor is collecting (which only ``record_function`` reports to),
it is torch's ``record_function``.

A subclass that defines its own ``step`` is wrapped by torch as usual; when that ``step`` calls
``super().step()``, the hooks are not run a second time. A class-level wrapper from elsewhere (a
profiler, a framework) around offload's ``step`` changes nothing: the hooks run once, inside it.
"""
from __future__ import annotations

import functools
import sys
from itertools import chain

import torch
from torch.optim import optimizer as _torch_optimizer

__all__ = ["hooked_step", "grad_off"]

_FAST_RANGE = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)
# the code of the wrapper Optimizer.__init__ puts around a class's own step(): it runs the hooks
# itself
_TORCH_WRAPPER_CODE = getattr(_torch_optimizer.Optimizer.profile_hook_step(lambda *a, **k: None),
                              "__code__", None)


def _hooks_ran_outside(f, mine) -> bool:
    """Whether the class's ``step`` ``f`` is (or wraps, through ``__wrapped__``) torch's hook
    wrapper around a subclass's own step, rather than ``mine`` itself or a wrapper around it."""
    for _ in range(32):
        if f is None or f is mine:
            return False
        if getattr(f, "__code__", None) is _TORCH_WRAPPER_CODE:
            return True
        f = getattr(f, "__wrapped__", None)
    return False


def _profiler_range(name: str):
    """A context manager that records ``name`` as a range for torch's profiler, as record_function
    does."""
    monitor = sys.modules.get("torch.profiler._cupti_monitor")
    if _FAST_RANGE is None or (monitor is not None
                               and getattr(monitor, "get_monitor", lambda: None)() is not None):
        return torch.autograd.profiler.record_function(name)
    return _FAST_RANGE(name)


def grad_off(func):
    """``func`` run with gradients off, the caller's grad mode restored after it: what
    ``@torch.no_grad()`` and torch's own step wrapper do around a step, for a fraction of the
    cost."""
    set_grad = getattr(torch._C, "_set_grad_enabled", None) or torch.set_grad_enabled
    is_grad = torch.is_grad_enabled

    @functools.wraps(func)
    def off(*args, **kwargs):
        prev = is_grad()
        set_grad(False)
        try:
            return func(*args, **kwargs)
        finally:
            set_grad(prev)
    return off


def hooked_step(func):
    """``func`` (an optimizer's ``step``) with torch's step hooks and profiler range; marked
    ``hooked`` so that ``Optimizer.__init__`` does not wrap it again."""
    @functools.wraps(func)
    def step(*args, **kwargs):
        self = args[0]
        cls_step = type(self).step
        # from a subclass's own step()
        if cls_step is not step and _hooks_ran_outside(cls_step, step):
            return func(*args, **kwargs)
        with _profiler_range(f"Optimizer.step#{type(self).__name__}.step"):
            if _torch_optimizer._global_optimizer_pre_hooks or self._optimizer_step_pre_hooks:
                for pre_hook in chain(_torch_optimizer._global_optimizer_pre_hooks.values(),
                                      self._optimizer_step_pre_hooks.values()):
                    result = pre_hook(self, args, kwargs)
                    if result is not None:
                        if isinstance(result, tuple) and len(result) == 2:
                            args, kwargs = result
                        else:
                            raise RuntimeError(f"{func} must return None or a tuple of (new_args, "
                                               f"new_kwargs), but got {result}.")
            out = func(*args, **kwargs)
            self._optimizer_step_code()
            if self._optimizer_step_post_hooks or _torch_optimizer._global_optimizer_post_hooks:
                for post_hook in chain(self._optimizer_step_post_hooks.values(),
                                       _torch_optimizer._global_optimizer_post_hooks.values()):
                    post_hook(self, args, kwargs)
            return out

    step.hooked = True
    return step
