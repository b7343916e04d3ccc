"""engine/grow.py: the state engine's layout grows: ``add_param_group`` (a new group laid out after the
existing state; undone if it fails part-way) and parameters frozen at construction that get their first
gradient (laid out late). Functions of the engine's public parts (engine/engine.py StateEngine: its
per-group lists, layout, registry, tier and parameter side); the engine calls them under its lock.
"""
from __future__ import annotations

import numpy as np

from ..base.dist import local
from ..params.base import LOW_PRECISION
from ..params.guards import check_overlaps
from ..state.layout import Shape

__all__ = ["add_group", "lay_out_late", "unplaced"]


def add_group(eng, params: list, amsgrad: bool) -> None:
    """Lay group ``params`` out after the existing state and grow the tier (and the staging ring)."""
    gi, nb, nbytes = len(eng.groups), len(eng.layout.buckets), eng.layout.nbytes
    check_overlaps(eng.local_groups + [[local(p) for p in params]], (), None, eng.mode)
    try:
        eng.groups.append(list(params))
        eng.local_groups.append([local(p) for p in params])
        eng.tracker.seen.append(np.full((len(params), 2), -1, dtype=np.int64))
        eng.amsgrad.append(bool(amsgrad))
        eng.dtypes.append([local(p).dtype for p in params])
        eng.numels.append([local(p).numel() for p in params])
        eng.layout.extend(eng.lay_out([eng.groups[gi]], gi))
        eng.registry.grow([len(g) for g in eng.groups])
        eng.tier.allocate(eng.layout)   # a tier that cannot grow (no space, no memory) stays as it was
    except BaseException:
        _drop_groups(eng, gi, nb, nbytes)   # nothing changed: the group is not added
        raise
    try:
        if eng.device is not None:
            eng.side.allocate(eng.layout)
        eng.side.extend(eng.groups)
    except BaseException as e:   # the tier grew for the group: refused until a load
        _drop_groups(eng, gi, nb, nbytes)
        eng.tier.shrink(eng.layout)   # a group added later is laid out in room of its own
        eng.tier.fail(e)
        raise


def _drop_groups(eng, gi: int, nb: int, nbytes: int) -> None:
    """Undo an add_group that failed part-way: groups from ``gi`` on and buckets from ``nb`` on go."""
    for per_group in (eng.groups, eng.local_groups, eng.tracker.seen, eng.amsgrad, eng.dtypes, eng.numels,
                      eng.registry.steps, eng.registry.ready):
        del per_group[gi:]
    del eng.layout.buckets[nb:]
    eng.layout.nbytes = nbytes
    for key in [k for k in eng.layout.of_param if k[0] >= gi]:
        del eng.layout.of_param[key]


def lay_out_late(eng, late: list) -> None:
    """Parameters frozen (requires_grad=False) at construction reserved nothing; the first time one
    has a gradient its state is laid out after the existing state (the file grows)."""
    shapes = []
    for gi, i in sorted(late):
        lp = local(eng.groups[gi][i])
        shapes.append(Shape(gi, i, lp.numel(), lp.element_size(),
                            master=eng.device is not None or lp.dtype in LOW_PRECISION))
    eng.layout.extend(eng.layout_of(shapes))
    eng.tier.allocate(eng.layout)
    if eng.device is not None:
        eng.side.allocate(eng.layout)


def unplaced(eng, gi: int) -> np.ndarray:
    """Bool mask of group gi's non-empty parameters that have no state laid out (yet); cached per layout."""
    key = (id(eng.layout), len(eng.layout.buckets), len(eng.layout.of_param), len(eng.groups[gi]))
    got = eng.__dict__.setdefault("_unplaced_masks", {}).get(gi)
    if got is None or got[0] != key:
        mask = np.array([bool(n) and not eng.layout.of_param.get((gi, i)) for i, n in enumerate(eng.numels[gi])],
                        dtype=bool)
        got = eng._unplaced_masks[gi] = (key, mask)
    return got[1]
