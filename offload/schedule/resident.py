"""schedule/resident.py: parameters whose Adam state stays on the GPU, stepped there exactly.

With device parameters the CPU steps each bucket as backward delivers its gradients; the buckets
backward reaches last (the model's first layers) have nothing left to hide behind, and their new
weights are the first the next forward needs. When the GPU has memory to spare, those parameters keep
an fp32 master and fp32 moments on the GPU and ``ResidentAdam`` steps them there with torch's fused
AdamW (Adam), in the same ``step()`` and with the same hyperparameters, gradient multiplier (1/loss
scale x clipping coefficient) and skip decision as the buckets the CPU steps. ``choose`` decides how
many buckets stay, from what the first steps measured.

The state is torch's layout (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, and
``master_param`` for bf16/fp16 parameters, as offload keeps it) in the outer optimizer's ``state``
under the same parameters, so ``state_dict()``, ``load_state_dict`` and checkpoints see one layout
whichever side steps a parameter. A bf16/fp16 parameter written by the user since the last step (a
``model.load_state_dict``, a write through ``p.data``) is adopted element by element into its master
before the step, as the CPU kernel does: where the parameter differs from round(master).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..base.dist import local
from ..base.dtypes import LOW_PRECISION

__all__ = ["ResidentAdam", "resident_bytes", "choose"]

_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def resident_bytes(p) -> int:
    """GPU bytes the state of parameter ``p`` takes when it stays there: fp32 moments, an fp32 master
    for bf16/fp16, and the fp32 gradient of the step (made from the parameter's gradient at step())."""
    lp = local(p)
    return lp.numel() * (8 + 4 + (4 if lp.dtype in LOW_PRECISION else 0))


def choose(sizes: List[int], arrive: List[float], cpu_s: List[float], backward_s: float,
           gpu_bytes: List[int], budget: int) -> int:
    """How many buckets, counted from the end of backward's order, stay on the GPU.

    ``sizes``/``gpu_bytes``/``cpu_s``: per bucket in backward order, its parameters' elements, the
    GPU bytes their state would take, the seconds the CPU takes to step it; ``arrive``: when its
    gradients are on the host, in seconds from the start of backward; ``backward_s``: the length of
    backward. The CPU steps the buckets in order as they arrive; the smallest number k of trailing
    buckets is kept on the GPU such that the CPU is done with the others by the end of backward, as
    far as ``budget`` bytes allow (never more buckets than fit)."""
    n = len(sizes)
    fits = 0   # the most trailing buckets the budget holds
    total = 0
    for b in range(n - 1, -1, -1):
        total += gpu_bytes[b]
        if total > budget:
            break
        fits += 1
    for k in range(0, fits + 1):   # the smallest k whose CPU part ends inside backward
        done = 0.0
        for b in range(n - k):
            done = max(done, arrive[b]) + cpu_s[b]
        if done <= backward_s:
            return k
    return fits


class ResidentAdam:
    """torch's fused (CUDA; foreach elsewhere) Adam/AdamW over fp32 masters of the parameters that stay."""

    def __init__(self, port, resident: Dict[int, List[torch.Tensor]], decoupled: bool):
        """``port``: the outer optimizer's StepPort (engine/port.py); ``resident``: outer group index ->
        its parameters whose state stays on the GPU."""
        self.port = port
        self.decoupled = decoupled
        self.group_of: List[int] = []
        self.params: List[torch.Tensor] = []
        self.masters: List[torch.Tensor] = []   # the parameter's own tensor when fp32 (stepped in place)
        self.own: List[bool] = []               # a master of its own (bf16/fp16 parameters)
        groups = []
        for gi, params in resident.items():
            if not params:
                continue
            g = port.groups()[gi]
            ms = [self._master(p) for p in params]
            groups.append({"params": ms, **{k: g[k] for k in _HYPER}})
            self.group_of.append(gi)
            self.params += params
            self.masters += ms
            self.own += [local(p).dtype in LOW_PRECISION for p in params]
        self.inner = None
        if groups:
            fused = all(local(p).device.type == "cuda" for p in self.params)
            cls = torch.optim.AdamW if decoupled else torch.optim.Adam
            self.inner = cls(groups, **({"fused": True} if fused else {"foreach": True}))

    @staticmethod
    def _master(p) -> torch.Tensor:
        """An fp32 master of a bf16/fp16 parameter; an fp32 parameter is its own (stepped in place)."""
        lp = local(p)
        return lp.detach().float().clone() if lp.dtype in LOW_PRECISION else lp.detach()

    def __bool__(self) -> bool:
        return self.inner is not None

    def gpu_bytes(self) -> int:
        return sum(resident_bytes(p) for p in self.params)

    def grads(self) -> List[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    @torch.no_grad()
    def adopt_writes(self) -> None:
        """Masters take the elements of bf16/fp16 parameters that differ from round(master)."""
        for p, m, own in zip(self.params, self.masters, self.own):
            if not own:
                continue
            lp = local(p)
            differs = lp.ne(m.to(lp.dtype))
            if bool(differs.any()):
                m[differs] = lp[differs].float()

    @torch.no_grad()
    def step(self, mult: float) -> None:
        """One step of every resident parameter that has a gradient, its gradient times ``mult``
        (the parameters' own ``grad`` stay as backward left them)."""
        if self.inner is None:
            return
        for ig, gi in enumerate(self.group_of):
            outer = self.port.groups()[gi]
            for k in _HYPER:
                self.inner.param_groups[ig][k] = outer[k]
        self.adopt_writes()
        kept, low = [], []
        for p, m, own in zip(self.params, self.masters, self.own):
            if p.grad is None:
                m.grad = None
                continue
            g = local(p.grad)
            if own:
                m.grad = g.float().mul_(mult) if mult != 1.0 else g.float()
                low.append((local(p), m))
            else:   # fp32: the parameter's storage is stepped in place, with a scaled copy of its grad
                m.grad = g if mult == 1.0 else g * mult
                kept.append(m)
        if not kept and not low:
            return
        self.inner.step()
        if low:
            torch._foreach_copy_([lp.detach() for lp, _ in low], [m for _, m in low])
        for m in kept + [m for _, m in low]:
            m.grad = None
        self.publish()

    def publish(self) -> None:
        """Each parameter's state, in offload's layout, in the outer optimizer's ``state``."""
        state = self.port.state()
        for p, m, own in zip(self.params, self.masters, self.own):
            st = self.inner.state.get(m)
            if not st:
                continue
            entry = dict(st)
            if own:
                entry["master_param"] = m.view(local(p).shape)
            state[p] = entry

    @torch.no_grad()
    def load(self) -> None:
        """After the outer ``load_state_dict``: each resident parameter's loaded state goes to the GPU."""
        if self.inner is None:
            return
        state = self.port.state()
        for p, m, own in zip(self.params, self.masters, self.own):
            st = state.get(p)
            self.inner.state.pop(m, None)
            if not st:
                if own:
                    m.copy_(local(p).float())
                continue
            if own:
                src = st.get("master_param")
                m.copy_(local(src).reshape(m.shape) if src is not None else local(p).float())
            inner = {k: local(v).detach().to(m.device).clone() if isinstance(v, torch.Tensor) else v
                     for k, v in st.items() if k != "master_param"}
            if "step" in inner and not isinstance(inner["step"], torch.Tensor):
                inner["step"] = torch.tensor(float(inner["step"]), dtype=torch.float32)
            self.inner.state[m] = inner
        self.publish()

    def state_of(self, p) -> Optional[dict]:
        for q, m in zip(self.params, self.masters):
            if q is p:
                return self.inner.state.get(m)
        return None
