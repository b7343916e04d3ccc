"""schedule/hooks.py: torch hooks that reach their engine object through a weak reference.

Tensor hooks are held from C++ and module hooks by torch's global registries, where the garbage
collector cannot see a cycle: a hook holding its engine strongly would keep the engine, its host
memory and its threads alive forever. ``weak_hook(obj, "method", *bound)`` returns a hook that
calls ``obj.method(*bound, *args)`` while ``obj`` lives, does nothing afterwards, and always
returns None (a forward pre-hook or tensor hook returning a value would replace its input).
``weak_module_hook`` is the same for global module hooks, which also run inside the forwards that
torch.compile traces: there they do nothing (see its docstring).
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["weak_hook", "weak_module_hook"]


def weak_hook(obj, method: str, *bound):
    ref = weakref.ref(obj)

    def hook(*args):
        o = ref()
        if o is not None:
            getattr(o, method)(*bound, *args)
    return hook


def weak_module_hook(obj, method: str):
    """``weak_hook`` for a global module hook: it does nothing while torch.compile traces a
    forward. Traced into, it would break the graph at every module, or make dynamo give up
    compiling the model at all, which then ran uncompiled in every step. Compiled code keeps only
    what was traced, so per-module waits cannot run in it anyway: step() waits for every upload
    itself once compiled code ran (schedule/uploads.compiled_code_in_use)."""
    inner = weak_hook(obj, method)

    def hook(*args):
        if not torch.compiler.is_compiling():
            inner(*args)
    return hook
