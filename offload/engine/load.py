"""engine/load.py: writing state into the tier outside a step, bucket by bucket:
``load_state_dict`` (``load``), re-reading fp32 masters from the parameters (``reload_masters``),
entries of opt.state taken over (``write_entries``) and the read-change-write of chosen buckets
they use (``rewrite_buckets``). Any failure part-way fails the tier, as in a step.

Functions of their inputs (layout, tier, registry, ...), called by engine/torchstate.py TorchViews
under the engine's lock; ``read_master(gi, i, start, n, dst, ...)`` is the parameter side's
(offload/params/).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..base.dist import local
from ..moments import format as mformat
from ..moments import compressed

__all__ = ["load", "reload_masters", "rewrite_buckets", "write_entries"]


def rewrite_buckets(layout, tier, hits: dict, apply) -> None:
    """Read, change (``apply(bucket, pieces, block)``) and write back the buckets ``hits`` ({bucket
    index: [pieces]}), then wait for the writes; a failure fails the tier, as in a step."""
    try:
        for bi, pieces in hits.items():
            b = layout.buckets[bi]
            blk = tier.acquire(b, True)
            apply(b, pieces, blk)
            tier.release(b, blk)
        tier.drain()
    except BaseException as e:
        tier.fail(e)
        raise


def write_entries(layout, tier, flat: dict, packed=None, remaster=(), read_master=None) -> None:
    """One read-change-write of every bucket holding a piece of the parameters given: fp32 sections
    ``flat`` ({(gi, i): {key: flat tensor}}), compressed tensors ``packed`` ({(gi, i): {kernel key:
    flat tensor}}) and, for ``remaster`` ({(gi, i)}), the master read from the parameter."""
    packed = packed or {}
    hits: dict = {}
    for key in set(flat) | set(packed) | set(remaster):
        for bi, pc in layout.of_param.get(key, []):
            hits.setdefault(bi, []).append(pc)

    def apply(b, pieces, blk):
        f32 = blk.data[:b.nbytes].view(torch.float32)
        for pc in pieces:
            row = (b.group, pc.param)
            for key, src in flat.get(row, {}).items():
                sec = b.section(key) // 4 + pc.pos
                f32[sec:sec + pc.n].copy_(src[pc.start:pc.start + pc.n])
            if row in packed:
                compressed.write_piece(b, pc, blk.data, packed[row])
            if row in remaster:
                sec = b.section("master_param") // 4 + pc.pos
                read_master(b.group, pc.param, pc.start, pc.n, f32[sec:sec + pc.n])
    if hits:
        rewrite_buckets(layout, tier, hits, apply)


def reload_masters(layout, tier, registry, which: set, read_master: Callable) -> None:
    """Re-read the fp32 master of the parameters ``which`` ({(gi, i)}) that have state, from the
    parameters."""
    hits = {}
    for b in layout.buckets:
        hit = [pc for pc in b.pieces if (b.group, pc.param) in which
               and registry.ready[b.group][pc.param]]
        if hit and b.master:
            hits[b.index] = hit

    def apply(b, pieces, blk):
        f32 = blk.data[:b.nbytes].view(torch.float32)
        for pc in pieces:
            sec = b.section("master_param") // 4 + pc.pos
            read_master(b.group, pc.param, pc.start, pc.n, f32[sec:sec + pc.n], changed_only=True)
    rewrite_buckets(layout, tier, hits, apply)


def load(entries: dict, *, layout, tier, registry, tracker, numels: list, moment_format: Callable,
         mode: str, read_master: Callable) -> None:
    """Replace the whole state by ``entries`` ((gi, i) -> state dict), bucket by bucket (checked
    first). Parameters without an entry start afresh at their next step (as with torch's loader). A
    missing 'master_param' is taken from the parameter (a state saved by torch.optim)."""
    packed = {}   # (gi, i) -> flat compressed tensors of the parameter's format
    for (gi, i), st in list(entries.items()):
        fmt = moment_format(gi, i)
        has_packed = any(mformat.parse_saved_key(k) for k in st)
        if not fmt.compressed and not has_packed:
            continue
        where = f"state of parameter {i} of group {gi}"
        conv = compressed.to_format(st, fmt, numels[gi][i], where)
        rest = {k: t for k, t in st.items() if not mformat.parse_saved_key(k)
                and k not in mformat.MOMENT_KEYS}
        if not fmt.compressed:   # a compressed state loaded into fp32 moments: decoded
            entries[(gi, i)] = dict(rest, **conv)
        else:
            packed[(gi, i)] = conv
            entries[(gi, i)] = dict(rest, exp_avg=None, exp_avg_sq=None)
    for (gi, i), st in entries.items():
        n = numels[gi][i]
        has_layout = bool(layout.of_param.get((gi, i)))
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in st:
                raise KeyError(f"state of parameter {i} of group {gi} has no '{key}'")
        for key, t in st.items():
            if key == "step" or not isinstance(t, torch.Tensor):
                continue
            if local(t).numel() != n:
                raise ValueError(f"state '{key}' of parameter {i} of group {gi} does not match "
                                 f"the parameter's {n} elements")
        if n and not has_layout:
            raise ValueError(f"state of parameter {i} of group {gi}: the parameter had "
                             "requires_grad=False when the optimizer was created with "
                             f"storage={mode!r}, so it has no room for state")
    try:
        for b in layout.buckets:
            hit = [pc for pc in b.pieces if (b.group, pc.param) in entries]
            if not hit:
                continue
            data = torch.zeros(b.nbytes, dtype=torch.uint8)
            f32 = data.view(torch.float32)
            for pc in hit:
                st = entries[(b.group, pc.param)]
                if b.moments.compressed:
                    compressed.write_piece(b, pc, data, packed[(b.group, pc.param)])
                for key, _size in b.keys:
                    if b.moments.compressed and key != "master_param":
                        continue
                    sec = b.section(key) // 4 + pc.pos
                    dst = f32[sec:sec + pc.n]
                    src = st.get(key)
                    if src is None and key == "master_param":
                        read_master(b.group, pc.param, pc.start, pc.n, dst)
                    elif src is not None:
                        dst.copy_(local(src).detach().reshape(-1)[pc.start:pc.start + pc.n])
            tier.write(b, data)
        registry.reset()
        for (gi, i), st in entries.items():
            v = st.get("step", 0.0)
            registry.steps[gi][i] = float(v.item() if isinstance(v, torch.Tensor) else v)
            registry.ready[gi][i] = True
            # the loaded master is the truth for the parameter as it is now
            tracker.record(gi, [i])
    except BaseException as e:
        tier.fail(e)
        raise
