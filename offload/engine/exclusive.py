"""engine/exclusive.py: the state engine's exclusive use (StateEngine.exclusive) and its check that
the state is used in the process that made it (not after fork()), as functions of what they read:
TorchViews (engine/torchstate.py) holds the first bound to the engine's lock and tier, without the
engine."""
from __future__ import annotations

import contextlib
import os

__all__ = ["check_process", "exclusive"]


@contextlib.contextmanager
def exclusive(lock, pid: int, tier, mode: str, plans, failed_ok: bool = False):
    """StateEngine.exclusive, as a function of what it reads (TorchViews holds it without the
    engine). It drops the step plan (``plans``: engine/fastpath.py PlanHolder): what runs under it
    may change what the plan holds."""
    check_process(pid, mode)
    with lock:
        plans.plan = None
        if not (failed_ok and tier.failed is not None and not tier.closed):
            tier.check_usable()
        yield


def check_process(pid: int, mode: str) -> None:
    if os.getpid() != pid:
        raise RuntimeError(
            f"the {mode} optimizer state of process {pid} cannot be used after fork() (this is "
            f"process {os.getpid()}): its state file, mapping and I/O threads belong to the "
            "parent. Create the optimizer in the child (or start it with the 'spawn' method)")
