"""state_dict.py: offload.Adam/AdamW's state_dict / load_state_dict in torch's layout (every mode:
RAM arenas, NVMe/mmap state, compressed moments, GPU offload), and the tensors a checkpoint saves.
A mixin of the optimizer class. The parameters torch's code steps (offload/fallback.py) keep their
state in ``opt.state`` in torch's layout with every tier; the state engine numbers only the others
(``_engine_index``)."""
from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from itertools import chain

import torch

from . import fallback
from .moments import format as mformat
from .base.dist import is_dtensor, local
from .checks import _scalar
from .step.compressed import CompressedState


class StateDictMixin:
    """state_dict() / load_state_dict() / checkpoint_tensors of offload.optim._AdamBase."""

    # ------------------------------------------------------------------ state_dict
    def state_dict(self) -> dict:
        self._check_usable()   # never hand out a partially updated state as a checkpoint
        if self._gpu is not None:
            self._gpu.synchronize()
        self._sync_engine()
        tensors = self._store.state_tensors()  # views of the tier (a mapped state file, an arena), not copies
        sd = self._state_dict_without_tier()
        for pos, index in self._engine_index().items():
            if index in sd["state"] and pos in tensors:
                sd["state"][index].update(tensors[pos])
        return sd

    def _engine_index(self) -> dict:
        """{(group, position in the state engine's list): index in torch's numbering}."""
        return fallback.engine_index(self.param_groups, self._engine_groups())

    def checkpoint_state(self) -> dict:
        """``state_dict()['state']`` without the tensors that ``checkpoint_tensors`` hands out (the
        moments and master weights kept in a tier): step counts and any other entries. offload.save
        uses it so that saving compressed moments never decodes them (a transient fp32 copy of every
        moment, 8 B per parameter in RAM)."""
        self._check_usable()
        if self._gpu is not None:
            self._gpu.synchronize()
        self._sync_engine()
        return self._state_dict_without_tier()["state"]

    def _state_dict_without_tier(self) -> dict:
        sd = super().state_dict()
        # hand out copies of step counters: ours are views into one shared buffer
        sd["state"] = {k: ({kk: (vv.clone() if kk == "step" and isinstance(vv, torch.Tensor) else vv)
                            for kk, vv in (v.plain() if isinstance(v, CompressedState) else v).items()}
                           if isinstance(k, int) and isinstance(v, (dict, CompressedState)) else v)
                       for k, v in sd["state"].items()}  # a non-parameter key (user data) is kept as is
        return sd

    @property
    def checkpoint_tensors(self):
        """``offload.save``'s extension point (offload/checkpoint/adapter.py): with compressed moments
        the checkpoint stores them compressed (``exp_avg.8bit``, scales, ...), so it resumes bitwise.
        None otherwise: the checkpoint then goes through ``state_dict()`` as for any optimizer."""
        if getattr(self, "moments", "fp32") == "fp32":
            return None
        return self._checkpoint_tensors

    def _checkpoint_tensors(self, create_from):
        from .checkpoint.adapter import tensor_ref
        if create_from is not None:  # never asked: this state loads through load_state_dict (loads_itself)
            raise RuntimeError("compressed-moment state loads through load_state_dict")
        self._sync_engine()
        tensors = self._store.raw_state_tensors()
        flat = [p for g in self.param_groups for p in g["params"]]
        refs = []
        for pos, index in sorted(self._engine_index().items(), key=lambda x: x[1]):
            if pos in tensors and self.state.get(flat[index]):
                for key in sorted(tensors[pos]):
                    r = tensor_ref(f"state.{index}.{key}", index, key, tensors[pos][key])
                    r.keep = self._store
                    refs.append(r)
        # parameters torch's code steps: their state tensors in opt.state, in torch's numbering (a parameter
        # listed twice in a group: its last position, as torch.optim.Optimizer.state_dict numbers it)
        last = {id(p): (index, p) for index, p in enumerate(flat) if self._router.is_fallback(self.param_groups, p)}
        for index, p in sorted(last.values(), key=lambda x: x[0]):
            refs.extend(tensor_ref(f"state.{index}.{key}", index, key, v) for key, v in sorted((self.state.get(p) or
                        {}).items()) if key != "step" and isinstance(v, torch.Tensor))
        return refs

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by this class or by ``torch.optim.Adam/AdamW``.

        Unlike torch, moments stay fp32 for bf16/fp16 parameters (torch would cast them to the
        parameter dtype); sizes are checked before anything is replaced.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        groups = self.param_groups
        self._sync_engine()   # (a group's params list edited: the engine is laid out for the groups as they are)
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                                 f"optimizer's group (group {gi}: {len(sg['params'])} saved, {len(g['params'])} here)")
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        new_state: defaultdict = defaultdict(dict)
        router = fallback.Router(announce=False)   # only asked which parameters use torch's layout
        for k, v in state_dict["state"].items():
            if k not in id_map:
                new_state[k] = v
                continue
            p = id_map[k]
            if self._gpu_device is None and router.is_fallback(groups, p):  # torch's layout (offload/fallback.py)
                for key, val in v.items():
                    if isinstance(val, torch.Tensor) and key != "step" and val.shape != p.shape:
                        raise ValueError(f"state '{key}' of saved parameter {k} has shape {tuple(val.shape)}, "
                                         f"but the parameter has shape {tuple(p.shape)}")
                new_state[p] = fallback.cast_state(p, deepcopy(v))
                continue
            st = {}
            for key, val in v.items():
                if key == "step":
                    st[key] = torch.tensor(_scalar(val), dtype=torch.float32)
                elif isinstance(val, torch.Tensor):
                    if mformat.parse_saved_key(key) is not None:   # compressed moments: checked by the engine
                        st[key] = val   # (decoded where this optimizer has fp32 moments)
                        continue
                    # a DTensor (FSDP2) parameter's state may come as its local shard (offload.load)
                    want = local(p).shape if is_dtensor(p) and not is_dtensor(val) else p.shape
                    if val.shape != want:
                        raise ValueError(f"state '{key}' of saved parameter {k} has shape {tuple(val.shape)}, "
                                         f"but the parameter has shape {tuple(want)}")
                    st[key] = val  # copied into the state's tier below (a file: one bucket at a time)
                else:
                    st[key] = deepcopy(val)
            new_state[p] = st
        for g, sg in zip(groups, saved_groups):
            sg["params"] = g["params"]
            if "param_names" in g and "param_names" not in sg:
                sg["param_names"] = g["param_names"]
        if self._gpu is not None:
            self._gpu.synchronize()
        native = self._router.split(saved_groups)[0]   # the groups the engine holds, as loaded
        if self._rebuildable and [bool(g.get("amsgrad", False)) for g in native] != self._store.amsgrad:
            # amsgrad differs from what the engine was laid out for: a new engine for the loaded state
            new_state.update(self._rebuild_engine(native, new_state))
        else:  # write the tensors into the tier (a file: bucket by bucket)
            flat = [p for g in groups for p in g["params"]]
            small = self._store.excluded   # GPU offload: small parameters stepped on the device keep torch's state
            # (gi, i) of the engine's parameters (not those torch's code steps: their state stays in opt.state)
            where = {id(flat[index]): pos for pos, index in self._engine_index().items() if pos not in small}
            entries = {where[id(p)]: st for p, st in new_state.items() if isinstance(p, torch.Tensor) and id(p) in where}
            self._store.load(entries)
            for p, st in list(new_state.items()):
                if isinstance(p, torch.Tensor) and id(p) in where:
                    gi, i = where[id(p)]
                    new_state[p] = self._store.torch_state(gi, i)  # step counter + views of the moments
        self.__setstate__({"state": new_state, "param_groups": saved_groups})
        if self._gpu is not None:
            self._gpu.load_state(loaded=True)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
