"""base/failstop.py: what an optimizer does when a step fails after it started changing things.

Every ``step()`` either completes or raises with parameters and optimizer state exactly as before
the call: everything a step validates is validated before anything is changed. Where a failure
comes after the first change (an I/O error once some buckets were written back, a device copy
that failed, an unexpected error inside the kernel pass) the optimizer is marked failed, and every
later step or state read raises :class:`OptimizerFailedError` until a checkpoint is loaded.
"""
from __future__ import annotations

__all__ = ["OptimizerFailedError", "RECOVERY", "detached", "failed_message"]

RECOVERY = ("load the last checkpoint into the model and the optimizer (offload.load(opt, "
            "directory), or model.load_state_dict(...) and opt.load_state_dict(...)) to "
            "continue from it")


class OptimizerFailedError(RuntimeError):
    """A step failed part-way: parameters and optimizer state may be partially updated, so the
    optimizer refuses every further step and state read until a checkpoint is loaded."""


def detached(exc: BaseException) -> BaseException:
    """A copy of ``exc`` without its traceback (whose frames would keep the step's gradients
    alive)."""
    try:
        return type(exc)(*exc.args)
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def failed_message(what: str, cause: BaseException) -> str:
    return (f"{what} is unusable after an earlier failure: a step failed part-way "
            f"({type(cause).__name__}: {cause}); parameters and state may be partially updated. "
            f"To recover, {RECOVERY}")
