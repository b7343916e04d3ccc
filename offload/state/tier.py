"""state/tier.py: the interface every state tier implements, and the one budget split.

A tier holds the bytes of every bucket of a layout (offload/state/layout.py). The step pipeline asks it
to ``prefetch`` the next buckets, ``acquire`` one (its bytes in host memory, as a ``Block``),
``release`` it after the kernel ran (write-back) and ``drain`` at the end. ``resident`` tiers
(ram, mmap) keep every bucket addressable, so views of them are the live state.

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

__all__ = ["Block", "StateTier", "StoreFailedError", "split_budget"]


class StoreFailedError(OptimizerFailedError):
    """The optimizer state of a tier can no longer be trusted (an earlier step failed part-way)."""


@dataclass
class Block:
    """A bucket's state bytes in host memory: ``data`` (uint8) starting at address ``base``."""
    base: int
    data: torch.Tensor
    slot: int = -1


class StateTier:
    kind = "abstract"
    resident = False
    inline = False   # acquire() gives a bucket the same bytes; prefetch/release/drain do nothing

    def __init__(self) -> None:
        self.failed: Optional[BaseException] = None
        self.layout = None
        self.telemetry = dict(bytes_read=0, bytes_written=0, read_wait_s=0.0, write_wait_s=0.0)

    # --- the pipeline's calls
    def allocate(self, layout) -> None:
        """Reserve room for ``layout`` (called again with a longer layout after ``add_param_group``)."""
        raise NotImplementedError

    def shrink(self, layout) -> None:
        """``layout`` lost the buckets it gained since an ``allocate`` (an add_param_group that failed after
        the tier grew): forget what was placed for them, so that buckets laid out later get room of
        their own. The memory or file space itself may stay."""
        self.layout = layout

    def prefetch(self, b, read: bool) -> None:
        """Start bringing bucket ``b`` into host memory (``read=False``: it is all fresh state)."""

    def acquire(self, b, read: bool) -> Block:
        raise NotImplementedError

    def reading(self) -> int:
        """Read-aheads in flight (0 for resident tiers: nothing to read)."""
        return 0

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
            raise StoreFailedError(failed_message(f"the {self.kind} optimizer state in {self.where()}",
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
        """The host memory the tier writes (for the gradient-aliasing check): a tensor, a list of them, or None."""
        return None


def split_budget(kind: str, budget: int, depth: int, staging_slots: int) -> tuple:
    """(max state bytes per bucket, max parameter bytes per bucket for staging) from ``host_budget``.

    nvme: ``depth + 2`` state slots and ``staging_slots`` staging slots (gradient + new weights of
    one bucket each) fit in ``budget``; a staging slot holds at most 2/3 of a state slot (fp32
    parameter: 8 bytes of staging per 12 of state). mmap: a bucket is at most the budget; the
    buckets that stay mapped between steps fit in it (state/mmap.py). ram: unbounded state buckets.
    """
    if kind == "ram":
        return None, None
    nslots = depth + 2 if kind == "nvme" else 1
    denom = nslots + (2 * staging_slots / 3 if staging_slots else 0)
    s = int(budget / denom) // ALIGN * ALIGN
    if kind == "mmap":
        s = max(s, ALIGN)
    stage = s // 3 if staging_slots else None
    return s, stage
