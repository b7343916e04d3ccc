"""schedule/frameworks.py: what training frameworks say about the step that offload cannot see
itself.

accelerate (and transformers' Trainer through it) decides which backward of a gradient accumulation
is the last; it tells DeepSpeed through ``set_gradient_accumulation_boundary`` and nobody else. The
device-parameter schedule that steps buckets during backward reads the same flag here.
"""
from __future__ import annotations

import sys

__all__ = ["accelerate_accumulating"]


def accelerate_accumulating() -> bool:
    """True inside a micro-batch that accelerate (``Accelerator.accumulate``) or transformers'
    Trainer (through accelerate's GradientState) marked as not the last of a gradient accumulation:
    its backward only accumulates, as inside ``optimizer.no_sync()``. accelerate gives DeepSpeed
    the same flag (``set_gradient_accumulation_boundary``); it has none for other optimizers.
    Looked up in sys.modules only: never imports accelerate."""
    mod = sys.modules.get("accelerate.state")
    shared = getattr(getattr(mod, "GradientState", None), "_shared_state", None)
    try:
        return shared is not None and shared.get("sync_gradients", True) is False
    except (AttributeError, TypeError):   # another accelerate's shared-state type: no opinion
        return False
