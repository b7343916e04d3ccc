"""engine/rebuild.py: a new state engine holding what ``opt.state`` holds, for host parameters with fp32
moments in RAM, the one configuration where every entry of ``opt.state`` can be copied in.

torch's AdamW keys its state by parameter, so a user may edit a param group's ``params`` list, switch
``amsgrad`` on or off between steps (with the entries it then needs), or pickle / ``copy.deepcopy``
the optimizer; torch's AdamW keeps working from ``opt.state`` as it is. The engine lays its state out
for fixed parameter lists, so for those changes it is built again and every parameter's entries are
loaded into it (once, O(model)); a parameter without state starts afresh as in torch. Nothing is
replaced until the new engine holds everything: a rebuild that raises changes nothing.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..base.dist import local
from ..base.dtypes import TENSOR_STATE_KEYS as _KEYS

__all__ = ["fits", "rebuild"]



def fits(engine, groups: Sequence[dict], amsgrad: bool = True) -> bool:
    """The engine was laid out for exactly these param groups (parameters by identity; and their
    amsgrad settings, unless ``amsgrad`` is False: reading the state does not depend on them)."""
    flags = [bool(g.get("amsgrad", False)) for g in groups] if amsgrad else None
    return engine.holds([g["params"] for g in groups], flags)


def _entries(groups: Sequence[dict], state, names: Callable[[int, int], str]) -> dict:
    out = {}
    for gi, g in enumerate(groups):
        for i, p in enumerate(g["params"]):
            st = state.get(p)
            if not st:
                continue
            e = {"step": st.get("step", 0.0)}
            e.update((k, st[k]) for k in _KEYS if st.get(k) is not None)
            if not g.get("amsgrad", False):
                e.pop("max_exp_avg_sq", None)
            elif "max_exp_avg_sq" not in e and local(p).numel():
                raise ValueError(
                    f"param group {gi} has amsgrad=True, but {names(gi, i)} has no 'max_exp_avg_sq' in its state "
                    "(amsgrad was switched on after its first step; torch.optim.AdamW raises KeyError here): set "
                    "amsgrad=False again, or give each such parameter one: "
                    "opt.state[p]['max_exp_avg_sq'] = torch.zeros_like(p, dtype=torch.float32)")
            out[(gi, i)] = e
    return out


def rebuild(make: Callable[[], object], groups: Sequence[dict], state, names: Callable[[int, int], str]) -> tuple:
    """(engine, {parameter: its new opt.state entry}) for ``groups`` (the engine's param groups) and
    ``state`` (``opt.state``); ``make()`` builds an empty engine for the groups as they are now."""
    entries = _entries(groups, state, names)
    engine = make()
    try:
        engine.load(entries)
        views = {groups[gi]["params"][i]: engine.torch_state(gi, i) for gi, i in entries}
    except BaseException:
        engine.close()
        raise
    return engine, views
