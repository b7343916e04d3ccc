"""state/tier.py: the interface every state tier implements, and the one budget split.

The checks of the settings the split takes (``depth``, ``staging_slots``, a budget too small for
the NVMe slots) are here too: the engine and ``offload.plan`` refuse the same values alike.

A tier holds the bytes of every bucket of a layout (offload/state/layout.py). The step pipeline
asks it to ``prefetch`` the next buckets, ``acquire`` one (its bytes in host memory, as a
``Block``), ``release`` it after the kernel ran (write-back) and ``drain`` at the end. ``resident``
tiers (ram, mmap) keep every bucket addressable, so views of them are the live state.

After any failure inside a step a tier refuses further use (``StoreFailedError``): parameters and
state may be partially updated, and continuing would silently train on garbage. A complete load
of the state (``recover``, after ``load_state_dict``) makes it usable again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..base.failstop import OptimizerFailedError, detached, failed_message
from .layout import ALIGN

__all__ = ["Block", "StateTier", "StoreFailedError", "split_budget", "check_depth",
           "check_staging_slots", "check_budget"]


class StoreFailedError(OptimizerFailedError):
    """The optimizer state of a tier can no longer be trusted (an earlier step failed part-way)."""


@dataclass
class Block:
    """A bucket's state bytes in host memory: ``data`` (uint8) starting at address ``base``."""
    base: int
    data: torch.Tensor
    slot: int = -1


class StateTier:
    storage = "abstract"
    resident = False
    inline = False   # acquire() gives a bucket the same bytes; prefetch/release/drain do nothing

    def __init__(self) -> None:
        self.failed: Optional[BaseException] = None
        self.layout = None
        self.telemetry = dict(bytes_read=0, bytes_written=0, read_wait_s=0.0, write_wait_s=0.0)

    # --- the pipeline's calls
    def allocate(self, layout) -> None:
        """Reserve room for ``layout`` (called again with a longer layout after
        ``add_param_group``)."""
        raise NotImplementedError

    def shrink(self, layout) -> None:
        """``layout`` lost the buckets it gained since an ``allocate`` (an add_param_group that
        failed after the tier grew): forget what was placed for them, so that buckets laid out
        later get room of their own. The memory or file space itself may stay."""
        self.layout = layout

    def prefetch(self, b, read: bool) -> None:
        """Start bringing bucket ``b`` into host memory (``read=False``: it is all fresh state)."""

    def acquire(self, b, read: bool) -> Block:
        raise NotImplementedError

    def prefetched(self, b) -> bool:
        return False

    def keep_reads(self, wanted) -> None:
        """Drop read-aheads of buckets not in ``wanted`` (bucket indices)."""

    def release(self, b, blk: Block) -> None:
        """The kernel is done with ``blk``: write it back (asynchronously where possible)."""

    def drain(self) -> None:
        """Every write-back finished; nothing in flight."""

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Readable (and, for resident tiers, writable live) uint8 bytes of the state."""
        raise NotImplementedError

    def write(self, b, data: torch.Tensor) -> None:
        """Replace bucket ``b``'s bytes (the load path)."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return False

    def info(self) -> dict:
        return dict(self.telemetry)

    # --- fail-stop
    def where(self) -> str:
        return "host memory"

    def check_usable(self) -> None:
        if self.failed is not None:
            raise StoreFailedError(failed_message(f"the {self.storage} optimizer state "
                                                  f"in {self.where()}",
                                                  self.failed)) from self.failed
        if self.closed:
            raise RuntimeError("the optimizer's state store is closed")

    def fail(self, exc: BaseException) -> None:
        if self.failed is None:   # the first failure is the one to report
            self.failed = detached(exc)

    def recover(self) -> None:
        """Every bucket's state was just replaced (a successful load): usable again."""
        self.failed = None

    def own_memory(self):
        """The host memory the tier writes (for the gradient-aliasing check): a tensor, a list of
        them, or None."""
        return None


def split_budget(storage: str, budget: int, depth: int, staging_slots: int) -> tuple:
    """(max state bytes per bucket, max parameter bytes per bucket for staging) from
    ``host_budget``.

    nvme: ``depth + 2`` state slots and ``staging_slots`` staging slots (gradient + new weights of
    one bucket each) fit in ``budget``; a staging slot holds at most 2/3 of a state slot (fp32
    parameter: 8 bytes of staging per 12 of state). mmap: a bucket is at most the budget; the
    buckets that stay mapped between steps fit in it (state/mmap.py). ram: unbounded state buckets.
    """
    if storage == "ram":
        return None, None
    nslots = depth + 2 if storage == "nvme" else 1
    denom = nslots + (2 * staging_slots / 3 if staging_slots else 0)
    s = int(budget / denom) // ALIGN * ALIGN
    if storage == "mmap":
        s = max(s, ALIGN)
    stage = s // 3 if staging_slots else None
    return s, stage


def check_depth(depth) -> int:
    """``nvme_options={'depth': n}``: buckets read ahead (per drive)."""
    if not isinstance(depth, int) or not 1 <= depth <= 64:
        raise ValueError(f"depth (buckets read ahead) must be an int in [1, 64], got {depth!r}")
    return depth


def check_staging_slots(slots) -> int:
    """``nvme_options={'staging_slots': n}``: the pinned staging ring of device parameters."""
    if not (isinstance(slots, int) and 1 <= slots <= 64):
        raise ValueError(f"staging_slots must be an int in [1, 64], got {slots!r}")
    return slots


def check_budget(storage: str, state_cap: Optional[int], depth: int, staging_slots: int,
                 host_budget) -> None:
    """NVMe state needs room for one 4 KiB bucket in each of its ``depth + 2`` slots (and the
    staging slots of device parameters, ``staging_slots``: 0 for host parameters); ``state_cap``
    from :func:`split_budget` with the same arguments. The message names the smallest budget
    that :func:`split_budget` accepts."""
    if storage == "nvme" and state_cap < ALIGN:
        need = int(ALIGN * (depth + 2 + 2 * staging_slots / 3))
        while split_budget(storage, need, depth, staging_slots)[0] < ALIGN:
            need += 1
        staging = (f" and 2/3 of one for each of {staging_slots} staging slots"
                   if staging_slots else "")
        raise ValueError(f"host_budget={host_budget!r} is too small: NVMe state needs at least "
                         f"{need} bytes (a {ALIGN}-byte buffer for each of its {depth + 2} "
                         f"slots{staging})")
