"""checkpoint/pending.py: the registry of background saves (save_async) per optimizer.

Keyed weakly by the optimizer that holds the state (a pending save never keeps it alive), plus
the set of saves whose outcome was not yet delivered (for the at-exit report). ``deliver`` waits
for an optimizer's pending save and raises its error once; save/load/save_async call it first.
"""
from __future__ import annotations

import threading
import weakref

from . import adapter

_guard = threading.RLock()
_locks: dict = {}
_pending: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> SaveHandle
# optimizer -> [RemovableHandle]
_spent_hooks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
live: set = set()  # handles whose outcome has not been delivered yet (strong: reported at exit)


def dir_lock(d: str) -> threading.Lock:
    with _guard:
        return _locks.setdefault(d, threading.Lock())


def register(target, handle) -> None:
    with _guard:
        _pending[target] = handle
        live.add(handle)


def unregister(target, handle) -> None:
    with _guard:
        live.discard(handle)
        if target is not None and _pending.get(target) is handle:
            del _pending[target]


def spend_hook(target, hook) -> None:
    """A step pre-hook that is done: removed at the next call outside step() (torch iterates over
    the hooks while calling them, so it cannot remove itself)."""
    if target is None or hook is None:
        return
    with _guard:
        _spent_hooks.setdefault(target, []).append(hook)


def remove_spent_hooks(target) -> None:
    with _guard:
        hooks = _spent_hooks.pop(target, [])
    for h in hooks:
        h.remove()


def deliver(optimizer, group=None) -> None:
    """Wait for ``optimizer``'s pending background save; raise its error once, then forget it."""
    target = adapter.resolve(optimizer, group)[0]
    with _guard:
        h = _pending.get(target)
    if h is not None:
        h._deliver()
    remove_spent_hooks(target)
