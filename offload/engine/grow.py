"""engine/grow.py: the state engine's layout grows: ``add_param_group`` (a new group laid out after
the existing state) and parameters frozen at construction that get their first gradient (laid out
late). A growth that cannot complete (a full drive, no memory) is undone: the layout, the tier's
placements and the engine's per-group lists are what they were before it.

It changes nothing in place itself: each piece of state is grown and cut back by its owner,
through one method each: the engine's per-group lists by StateEngine.append_group / drop_groups
(with the write tracker's and the registry's), the layout by Layout.extend / truncate, the tier's
and the parameter side's placements by their allocate / shrink / drop_buckets. The engine calls
these functions under its lock.
"""
from __future__ import annotations

from ..base.dist import local
from ..params.base import LOW_PRECISION
from ..params.guards import check_overlaps
from ..state.layout import Shape

__all__ = ["add_group", "lay_out_late"]


def add_group(eng, params: list, amsgrad: bool) -> None:
    """Lay group ``params`` out after the existing state and grow the tier (and the staging
    ring)."""
    gi, nb, nbytes = len(eng.groups), len(eng.layout.buckets), eng.layout.nbytes
    check_overlaps(eng.local_groups + [[local(p) for p in params]], (), None, eng.mode)
    try:
        eng.append_group(params, amsgrad)
        eng.layout.extend(eng.lay_out([eng.groups[gi]], gi))
        eng.registry.grow([len(g) for g in eng.groups])
        # a tier that cannot grow (no space, no memory) stays as it was
        eng.tier.allocate(eng.layout)
    except BaseException:
        eng.drop_groups(gi)   # nothing changed: the group is not added
        _truncate(eng, nb, nbytes, {})
        raise
    try:
        eng.side.allocate(eng.layout)
        eng.side.extend(eng.groups)
    except BaseException as e:   # the tier grew for the group: refused until a load
        eng.drop_groups(gi)
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
    """The layout back to its first ``nb`` buckets (Layout.truncate); the tier and the parameter
    side forget the buckets that went."""
    gone = eng.layout.truncate(nb, nbytes, was)
    eng.tier.shrink(eng.layout)
    eng.side.drop_buckets(gone)


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
