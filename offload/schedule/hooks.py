"""schedule/hooks.py: torch hooks that reach their engine object through a weak reference.

Tensor hooks are held from C++ and module hooks by torch's global registries, where the garbage
collector cannot see a cycle: a hook holding its engine strongly would keep the engine, its host
memory and its threads alive forever. ``weak_hook(obj, "method", *bound)`` returns a hook that
calls ``obj.method(*bound, *args)`` while ``obj`` lives, does nothing afterwards, and always
returns None (a forward pre-hook or tensor hook returning a value would replace its input).
"""
from __future__ import annotations

import weakref

__all__ = ["weak_hook"]


def weak_hook(obj, method: str, *bound):
    ref = weakref.ref(obj)

    def hook(*args):
        o = ref()
        if o is not None:
            getattr(o, method)(*bound, *args)
    return hook
