"""optim/torch_state.py: the bodies of offload.Adam/AdamW's state_dict / load_state_dict in torch's
layout (every mode: RAM arenas, NVMe/mmap state, compressed moments, GPU offload), and of the
tensors a checkpoint saves. Functions of explicit inputs (torch's ``state_dict()`` of the
optimizer, its param groups, the state engine, the engine's numbering ``index``), which the
optimizer's methods (optim/adam.py) call. The parameters torch's code steps
(offload/optim/fallback.py) keep their state in ``opt.state`` in torch's layout with every tier;
the state engine numbers only the others (``index``: {(group, position in the engine's list):
torch's index})."""
from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from itertools import chain
from typing import Callable, Optional

import torch

from . import fallback
from ..moments import format as mformat
from ..base.dist import is_dtensor, local
from .checks import _scalar
from ..moments.compressed import CompressedState

__all__ = ["plain", "with_tensors", "checkpoint_tensors", "pre_hooks", "post_hooks", "map_saved",
           "install"]


# ------------------------------------------------------------------ state_dict
def plain(sd: dict) -> dict:
    """torch's ``Optimizer.state_dict()`` of the optimizer with the entries in torch's layout:
    compressed moments' entries as plain dicts, step counters copied (ours are views into one
    shared buffer)."""
    sd["state"] = {k: ({kk: (vv.clone() if kk == "step" and isinstance(vv, torch.Tensor) else vv)
                        for kk, vv in (v.plain() if isinstance(v, CompressedState) else v).items()}
                       if isinstance(k, int) and isinstance(v, (dict, CompressedState)) else v)
                   # a non-parameter key (user data) is kept as is
                   for k, v in sd["state"].items()}
    return sd


def with_tensors(sd: dict, tensors: dict, index: dict) -> dict:
    """``sd`` (from :func:`plain`) with the engine's ``state_tensors()`` (views of the tier)
    added."""
    for pos, i in index.items():
        if i in sd["state"] and pos in tensors:
            sd["state"][i].update(tensors[pos])
    return sd


def checkpoint_tensors(groups: list, state, engine, index: dict, router) -> list:
    """The tensor references a checkpoint of compressed moments saves
    (offload/checkpoint/adapter.py)."""
    from ..checkpoint.adapter import tensor_ref
    tensors = engine.raw_state_tensors()
    flat = [p for g in groups for p in g["params"]]
    refs = []
    for pos, i in sorted(index.items(), key=lambda x: x[1]):
        if pos in tensors and state.get(flat[i]):
            for key in sorted(tensors[pos]):
                r = tensor_ref(f"state.{i}.{key}", i, key, tensors[pos][key])
                r.keep = engine
                refs.append(r)
    # parameters torch's code steps: their state tensors in opt.state, in torch's numbering (a
    # parameter listed twice in a group: its last position, as torch.optim.Optimizer.state_dict
    # numbers it)
    last = {id(p): (i, p) for i, p in enumerate(flat) if router.is_fallback(groups, p)}
    for i, p in sorted(last.values(), key=lambda x: x[0]):
        refs.extend(tensor_ref(f"state.{i}.{key}", i, key, v) for key, v in sorted((state.get(p) or
                    {}).items()) if key != "step" and isinstance(v, torch.Tensor))
    return refs


# ------------------------------------------------------------------ load_state_dict
def pre_hooks(opt, state_dict: dict) -> dict:
    """torch's load_state_dict pre-hooks of ``opt``, in order; what they return replaces the state
    dict."""
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        hook_result = pre_hook(opt, state_dict)
        if hook_result is not None:
            state_dict = hook_result
    return state_dict


def post_hooks(opt) -> None:
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def map_saved(groups: list, state_dict: dict, host: bool) -> tuple:
    """(state keyed by the live parameters, the saved param groups holding the live params lists)
    of ``state_dict``, checked against ``groups`` (counts, sizes, shapes) before anything is
    replaced. ``host``: parameters on the CPU (those torch's code steps keep torch's layout)."""
    saved_groups = deepcopy(state_dict["param_groups"])
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             f"the size of optimizer's group (group {gi}: {len(sg['params'])} "
                             f"saved, {len(g['params'])} here)")
    id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                      chain.from_iterable(g["params"] for g in groups)))
    new_state: defaultdict = defaultdict(dict)
    router = fallback.Router(announce=False)   # only asked which parameters use torch's layout
    for k, v in state_dict["state"].items():
        if k not in id_map:
            new_state[k] = v
            continue
        p = id_map[k]
        if host and router.is_fallback(groups, p):  # torch's layout (offload/optim/fallback.py)
            for key, val in v.items():
                if isinstance(val, torch.Tensor) and key != "step" and val.shape != p.shape:
                    raise ValueError(f"state '{key}' of saved parameter {k} has shape "
                                     f"{tuple(val.shape)}, but the parameter has shape "
                                     f"{tuple(p.shape)}")
            new_state[p] = fallback.cast_state(p, deepcopy(v))
            continue
        st = {}
        for key, val in v.items():
            if key == "step":
                st[key] = torch.tensor(_scalar(val), dtype=torch.float32)
            elif isinstance(val, torch.Tensor):
                # compressed moments: checked by the engine
                if mformat.parse_saved_key(key) is not None:
                    st[key] = val   # (decoded where this optimizer has fp32 moments)
                    continue
                # a DTensor (FSDP2) parameter's state may come as its local shard (offload.load)
                want = local(p).shape if is_dtensor(p) and not is_dtensor(val) else p.shape
                if val.shape != want:
                    raise ValueError(f"state '{key}' of saved parameter {k} has shape "
                                     f"{tuple(val.shape)}, but the parameter has "
                                     f"shape {tuple(want)}")
                st[key] = val  # copied into the state's tier below (a file: one bucket at a time)
            else:
                st[key] = deepcopy(val)
        new_state[p] = st
    for g, sg in zip(groups, saved_groups):
        sg["params"] = g["params"]
        if "param_names" in g and "param_names" not in sg:
            sg["param_names"] = g["param_names"]
    return new_state, saved_groups


def install(new_state: dict, groups: list, native: list, engine, index: Callable[[], dict],
            rebuild: Optional[Callable[[list, dict], dict]]) -> None:
    """Put the engine's entries of ``new_state`` into the state tier (a file: bucket by bucket) and
    replace them by the engine's views. ``native``: the loaded groups the engine holds; ``rebuild``
    (or None where the configuration cannot): a new engine for ``native`` holding the state, used
    where amsgrad differs from what the engine was laid out for."""
    if rebuild is not None and [bool(g.get("amsgrad", False)) for g in native] != engine.amsgrad:
        new_state.update(rebuild(native, new_state))
        return
    flat = [p for g in groups for p in g["params"]]
    # GPU offload: small parameters stepped on the device keep torch's state
    small = engine.excluded
    # (gi, i) of the engine's parameters (not those torch's code steps: their state stays in
    # opt.state)
    where = {id(flat[i]): pos for pos, i in index().items() if pos not in small}
    entries = {where[id(p)]: st for p, st in new_state.items() if isinstance(p, torch.Tensor)
               and id(p) in where}
    engine.load(entries)
    for p, st in list(new_state.items()):
        if isinstance(p, torch.Tensor) and id(p) in where:
            gi, i = where[id(p)]
            new_state[p] = engine.torch_state(gi, i)  # step counter + views of the moments
