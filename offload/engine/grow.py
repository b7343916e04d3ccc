"""engine/grow.py: the state engine's layout grows: ``add_param_group`` (a new group laid out after the
existing state) and parameters frozen at construction that get their first gradient (laid out
late). A growth that cannot complete (a full drive, no memory) is undone: the layout, the tier's
placements and the engine's lists are as before. Functions of the engine's public parts
(engine/engine.py StateEngine: its per-group lists, layout, registry, tier and parameter side);
the engine calls them under its lock.
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
        _drop_groups(eng, gi)   # nothing changed: the group is not added
        _truncate(eng, nb, nbytes, {})
        raise
    try:
        eng.side.allocate(eng.layout)
        eng.side.extend(eng.groups)
    except BaseException as e:   # the tier grew for the group: refused until a load
        _drop_groups(eng, gi)
        _truncate(eng, nb, nbytes, {})   # a group added later is laid out in room of its own
        eng.tier.fail(e)
        raise


def _allocate(eng, nb: int, nbytes: int, was: dict) -> None:
    """Grow the tier and the staging for the layout's buckets from ``nb`` on; if either cannot
    grow, the layout is cut back to its first ``nb`` buckets (``nbytes`` bytes; ``was``: the
    entries of ``of_param`` the growth replaced) and the tier forgets what it placed for the
    rest."""
    try:
        eng.tier.allocate(eng.layout)
        eng.side.allocate(eng.layout)   # (a staging ring only grows: a larger one stays valid)
    except BaseException:
        _truncate(eng, nb, nbytes, was)
        raise


def _truncate(eng, nb: int, nbytes: int, was: dict) -> None:
    """The layout back to its first ``nb`` buckets; of_param's entries from ``was`` (None: none).
    The tier and the parameter side forget the buckets that went."""
    lay = eng.layout
    gone = {b.index for b in lay.buckets[nb:]}
    del lay.buckets[nb:]
    lay.nbytes = nbytes
    for key in [k for k, v in lay.of_param.items() if any(bi in gone for bi, _pc in v)]:
        del lay.of_param[key]
    for key, v in was.items():
        if v is not None:
            lay.of_param[key] = v
    eng.tier.shrink(lay)
    eng.side.drop_buckets(gone)


def _drop_groups(eng, gi: int) -> None:
    """Undo an add_group that failed part-way: the groups from ``gi`` on go (layout: _truncate)."""
    for per_group in (eng.groups, eng.local_groups, eng.tracker.seen, eng.amsgrad, eng.dtypes, eng.numels,
                      eng.registry.steps, eng.registry.ready):
        del per_group[gi:]
    for key in [k for k in eng.layout.of_param if k[0] >= gi]:
        del eng.layout.of_param[key]


def lay_out_late(eng, keys, state=None) -> None:
    """Parameters frozen (requires_grad=False) at construction reserved nothing; those of ``keys``
    ((gi, i), about to be stepped) that have no state laid out get it after the existing state (the
    file grows). If the tier or the staging cannot grow, nothing changes: they still have none.
    ``state`` (opt.state): an entry a user gave such a parameter is its state from then on, as in
    torch."""
    late = sorted((gi, i) for gi, i in keys if eng.numels[gi][i]
                  and not eng.layout.of_param.get((gi, i)) and (gi, i) not in eng.excluded)
    if not late:
        return
    shapes = []
    for gi, i in late:
        lp = local(eng.groups[gi][i])
        shapes.append(Shape(gi, i, lp.numel(), lp.element_size(),
                            master=eng.side.all_masters or lp.dtype in LOW_PRECISION))
    lay = eng.layout
    nb, nbytes = len(lay.buckets), lay.nbytes
    was = {key: lay.of_param.get(key) for key in late}
    lay.extend(eng.layout_of(shapes))
    _allocate(eng, nb, nbytes, was)
    if state is not None:
        eng.views.adopt_user_state(state, only=set(late))


def unplaced(eng, gi: int) -> np.ndarray:
    """Bool mask of group gi's non-empty parameters that have no state laid out (yet); cached per layout."""
    key = (id(eng.layout), len(eng.layout.buckets), len(eng.layout.of_param), len(eng.groups[gi]))
    got = eng.__dict__.setdefault("_unplaced_masks", {}).get(gi)
    if got is None or got[0] != key:
        mask = np.array([bool(n) and not eng.layout.of_param.get((gi, i)) for i, n in enumerate(eng.numels[gi])],
                        dtype=bool)
        got = eng._unplaced_masks[gi] = (key, mask)
    return got[1]
