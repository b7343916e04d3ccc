"""state/ram.py: RamTier, every bucket in one 4 KiB-aligned host arena (never pinned).

Pages are untouched until a bucket's first step writes them (fresh state is written, not
pre-zeroed), so an optimizer whose parameters never get gradients costs no RSS.
"""
from __future__ import annotations

import torch

from ..base.memory import aligned_empty
from .tier import Block, StateTier

__all__ = ["RamTier"]


class RamTier(StateTier):
    storage = "ram"
    resident = True
    inline = True

    def __init__(self) -> None:
        super().__init__()
        self.arenas: list = []   # (offset, tensor): one per allocate() (add_param_group appends)
        self.nbytes = 0
        self.blocks: dict = {}   # (offset, nbytes) -> Block, made once per arena layout (acquire)

    def allocate(self, layout) -> None:
        if layout.nbytes > self.nbytes:
            self.arenas.append((self.nbytes, aligned_empty(layout.nbytes - self.nbytes)))
            self.nbytes = layout.nbytes
        self.layout = layout
        self.blocks = {}

    def shrink(self, layout) -> None:
        self.arenas = [(start, arena) for start, arena in self.arenas
                       if start < max(layout.nbytes, 1)]
        self.nbytes = self.arenas[-1][0] + self.arenas[-1][1].numel() if self.arenas else 0
        self.layout = layout
        self.blocks = {}

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        for start, arena in reversed(self.arenas):
            if offset >= start:
                out = arena[offset - start:offset - start + nbytes]
                # (the kernel writes through its address: never past an arena)
                if out.numel() != nbytes:
                    raise RuntimeError(f"state bytes [{offset}, {offset + nbytes}) lie outside "
                                       "the RAM tier's arenas")
                return out
        raise IndexError(offset)

    def own_memory(self):
        return [arena for _, arena in self.arenas]

    def mapping(self):
        return self.view, None

    def acquire(self, b, read: bool) -> Block:
        # the same view every step (no torch op per bucket), until the arenas change
        blk = self.blocks.get((b.offset, b.nbytes))
        if blk is None:
            data = self.view(b.offset, b.nbytes)
            blk = self.blocks[(b.offset, b.nbytes)] = Block(data.data_ptr(), data)
        return blk

    def info(self) -> dict:
        d = super().info()
        d.update(arena_bytes=self.nbytes, pinned=False)
        return d

    def write(self, b, data: torch.Tensor) -> None:
        self.view(b.offset, b.nbytes).copy_(data)
