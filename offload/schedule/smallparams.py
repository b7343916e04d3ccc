"""schedule/smallparams.py: small parameters (norms, biases) kept and stepped on the device, as
torchao does.

Below a size threshold, sending a parameter's gradient down and its weight back up costs more in
per-copy latency than the CPU step saves. ``DeviceSideAdam`` steps those parameters where they are
with torch's own Adam/AdamW (fused on CUDA, foreach elsewhere), in the same ``step()`` and with the
same hyperparameters, gradient multiplier (1/loss scale x clipping coefficient) and skip decision
as the offloaded buckets. Their state is torch's (in the parameter dtype, on the device, no fp32
master) and appears in the outer optimizer's ``state`` / ``state_dict`` under the same indices.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..base.dist import local
from ..base.torchadam import HYPER_KEYS, check_state, follow_groups

__all__ = ["DeviceSideAdam", "small_params"]

_STEP_DTYPES = (torch.float32, torch.float64)   # the step counts torch's foreach/fused code groups


class DeviceSideAdam:
    def __init__(self, port, small: Dict[int, List[torch.Tensor]], decoupled: bool):
        """``port``: the outer optimizer's StepPort (engine/port.py); ``small``: outer group index
        -> its small parameters."""
        self.port = port
        self.group_of = []           # inner group index -> outer group index
        groups = []
        for gi, params in small.items():
            if params:
                g = port.groups()[gi]
                groups.append({"params": params, **{k: g[k] for k in HYPER_KEYS}})
                self.group_of.append(gi)
        self.params = [p for g in groups for p in g["params"]]
        self.inner = None
        if groups:
            fused = all(p.device.type == "cuda" for p in self.params)
            cls = torch.optim.AdamW if decoupled else torch.optim.Adam
            kw = {"fused": True} if fused else {"foreach": True}
            self.inner = cls(groups, **kw)

    def __bool__(self) -> bool:
        return self.inner is not None

    def grads(self) -> List[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def check(self) -> None:
        """What torch's Adam code would raise on part-way in these parameters' state (an entry of
        opt.state edited or replaced: base/torchadam.py, and a step its foreach and fused code
        cannot group: not a float32/float64 tensor), refused by name before anything is stepped."""
        if self.inner is None:
            return
        groups = self.port.groups()
        for ig, gi in enumerate(self.group_of):
            for p in self.inner.param_groups[ig]["params"]:
                st = self.inner.state.get(p)
                if not st:
                    continue
                i = next(k for k, q in enumerate(groups[gi]["params"]) if q is p)
                step = st.get("step")
                if isinstance(step, torch.Tensor) and step.dtype not in _STEP_DTYPES:
                    raise ValueError(f"state 'step' of parameter {i} of group {gi} is a "
                                     f"{step.dtype} tensor: torch's foreach and fused Adam take a "
                                     "float32 or float64 one (opt.state[p]['step'] = "
                                     "torch.tensor(10.0))")
                check_state(p, st, groups[gi], f"parameter {i} of group {gi}")

    def step(self, mult: float) -> None:
        if self.inner is None:
            return
        self.check()
        follow_groups(self.inner, self.port.groups(), self.group_of)
        g = self.grads()
        if not g:
            return
        if mult != 1.0:   # fold 1/loss scale and the clipping coefficient, as the CPU kernel does
            torch._foreach_mul_(g, mult)
        self.inner.step()
        for p in self.params:
            if p in self.inner.state:
                self.port.state()[p] = self.inner.state[p]   # the same dict: state_dict sees it

    def load(self) -> None:
        """After the outer ``load_state_dict``: hand each small parameter's loaded state to
        torch."""
        if self.inner is None:
            return
        sd = self.inner.state_dict()
        state = {}
        for i, p in enumerate(self.params):
            st = self.port.state().get(p)
            if st:
                # copies: the loaded state_dict's tensors stay the caller's (torch would alias
                # them)
                state[i] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in st.items() if k != "master_param"}
        sd["state"] = state
        self.inner.load_state_dict(sd)   # torch casts to the parameter's device and dtype
        for p in self.params:
            if p in self.inner.state:
                self.port.state()[p] = self.inner.state[p]
            else:
                self.port.state().pop(p, None)


def small_params(param_groups: list, small_param_numel: int) -> set:
    """(gi, i) of the parameters of at most ``small_param_numel`` elements: stepped on the
    device."""
    if not (isinstance(small_param_numel, int) and not isinstance(small_param_numel, bool)
            and small_param_numel >= 0):
        raise ValueError(f"small_param_numel must be an int >= 0, got {small_param_numel!r}")
    if not small_param_numel:
        return set()
    return {(gi, i) for gi, g in enumerate(param_groups) for i, p in enumerate(g["params"])
            if local(p).numel() <= small_param_numel}
