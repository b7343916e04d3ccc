"""engine/rebuild.py: a new state engine holding what ``opt.state`` holds, in every configuration.

torch's AdamW keys its state by parameter, so a user may edit a param group's ``params`` list (move
a parameter to a group of its own for a per-layer lr), switch ``amsgrad`` on or off between steps,
or pickle / ``copy.deepcopy`` the optimizer; torch's AdamW keeps working from ``opt.state`` as
it is. The engine lays its state out for fixed parameter lists, so for those changes it is built
again and every parameter's entry is loaded into it (once, O(model); with NVMe/mmap state into a
new state file), in its stored form (compressed moments as they are: bitwise); a parameter
without state starts afresh as in torch. A parameter the new groups no longer hold keeps its
entry, as torch keeps it, on copies of its own (the old engine closes), and goes on from it if it
is added back; so does ``max_exp_avg_sq`` while amsgrad is off. Nothing is replaced until the
new engine holds everything: a rebuild that raises changes nothing.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..base.dist import local
from ..base.dtypes import TENSOR_STATE_KEYS as _KEYS
from ..moments.compressed import CompressedState
from . import grow

__all__ = ["fits", "rebuild"]


def fits(engine, groups: Sequence[dict], amsgrad: bool = True) -> bool:
    """The engine was laid out for exactly these param groups (parameters by identity; and their
    amsgrad settings, unless ``amsgrad`` is False: reading the state does not depend on them)."""
    flags = [bool(g.get("amsgrad", False)) for g in groups] if amsgrad else None
    return engine.holds([g["params"] for g in groups], flags)


def _entries(groups: Sequence[dict], state, names: Callable[[int, int], str]) -> tuple:
    """({(gi, i): stored entry to load}, {(gi, i): max_exp_avg_sq kept while amsgrad is off})."""
    out, kept = {}, {}
    for gi, g in enumerate(groups):
        for i, p in enumerate(g["params"]):
            st = state.get(p)
            if not st:
                continue
            e = {"step": st.get("step", 0.0)}
            if isinstance(st, CompressedState):   # the compressed bytes as they are
                e.update(st.stored())
                e.update((k, st[k]) for k in ("master_param",) if st.get(k) is not None)
            else:
                e.update((k, st[k]) for k in _KEYS if st.get(k) is not None)
            if not g.get("amsgrad", False):
                if isinstance(e.get("max_exp_avg_sq"), torch.Tensor):
                    kept[(gi, i)] = e["max_exp_avg_sq"].detach().clone()
                e.pop("max_exp_avg_sq", None)
            elif "max_exp_avg_sq" not in e and local(p).numel():
                raise ValueError(
                    f"param group {gi} has amsgrad=True, but {names(gi, i)} has no "
                    "'max_exp_avg_sq' in its state (amsgrad was switched on after its first "
                    "step; torch.optim.AdamW raises KeyError here): set amsgrad=False again, or "
                    "give each such parameter one: opt.state[p]['max_exp_avg_sq'] = "
                    "torch.zeros_like(p, dtype=torch.float32)")
            out[(gi, i)] = e
    return out, kept


def _keep_own(st, p) -> None:
    """``st``, the entry of a parameter the new engine does not hold: on memory of its own."""
    if isinstance(st, CompressedState):
        st.detach(local(p).shape)
    elif st:
        for k, t in list(st.items()):
            # (a device's: not the tier's)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st[k] = t.detach().clone()


def rebuild(make: Callable[[], object], groups: Sequence[dict], state,
            names: Callable[[int, int], str], old_params: Sequence[torch.Tensor] = ()) -> tuple:
    """(engine, {parameter: its new opt.state entry}) for ``groups`` (the engine's param groups)
    and ``state`` (``opt.state``); ``make()`` builds an empty engine for the groups as they are
    now; ``old_params``: those whose state the engine being replaced holds (in its tier)."""
    entries, kept = _entries(groups, state, names)
    engine = make()
    try:
        # small parameters stepped on the device keep torch's entries (schedule/smallparams.py)
        entries = {k: e for k, e in entries.items() if k not in engine.excluded}
        late = [(gi, i) for gi, i in entries if local(groups[gi]["params"][i]).numel()
                and not engine.layout.of_param.get((gi, i))]
        if late:   # frozen when the engine was made (no room yet), but with state to keep
            grow.lay_out_late(engine, late)
        engine.load(entries)
        views = {}
        for gi, i in entries:
            views[groups[gi]["params"][i]] = st = engine.torch_state(gi, i)
            if (gi, i) in kept:
                st["max_exp_avg_sq"] = kept[(gi, i)]   # (torch keeps it, unused while it is off)
    except BaseException:
        engine.close()
        raise
    held = {id(groups[gi]["params"][i]) for gi, g in enumerate(groups)
            for i in range(len(g["params"]))
            # (the parameters the new engine holds the state of)
            if (gi, i) not in engine.excluded}
    for p in old_params:
        if id(p) not in held:   # no longer in a group, or stepped on the device from now on
            _keep_own(state.get(p), p)
    return engine, views
