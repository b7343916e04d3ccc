"""schedule/owners.py: ForwardObserver, which module of the observed forward reads which
parameters.

The waits for new weights (schedule/uploads.py) run in module forward pre-hooks and cover a
module's own parameters. Some modules read parameters of submodules whose forward they never call:
``nn.MultiheadAttention`` hands ``out_proj.weight`` and ``.bias`` to
``F.multi_head_attention_forward`` without running ``out_proj`` (so do
``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer`` and ``nn.Transformer``), and a
custom block may call ``F.linear(x, self.child.weight)``. Without more, such a read would see the
weights before the step.

Until the first ``step()``, a global module pre-hook records the modules that run, in order. At the
first step every parameter whose owner module never ran is *claimed* by its nearest ancestor that
did run: that ancestor's pre-hook waits for those parameters' buckets too, and their buckets take
the ancestor's place in the forward order (the upload order of the deferred schedule). The owner
module itself still gets its ``state_dict`` wait (``UploadWaits.note``).

Not covered: a parameter read before its owner (or its claiming ancestor) runs by a module outside
that subtree (e.g. a weight read by a sibling that runs first). docs/gpu.md says so.
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable, List

__all__ = ["ForwardObserver"]


class ForwardObserver:
    def __init__(self):
        self._ran: List[weakref.ref] = []   # modules in the order their first pre-hook ran
        self._ids: set = set()

    def saw(self, module) -> None:
        if id(module) not in self._ids:
            self._ids.add(id(module))
            self._ran.append(weakref.ref(module))

    def __bool__(self) -> bool:
        return bool(self._ran)

    def modules(self) -> list:
        return [m for m in (r() for r in self._ran) if m is not None]

    def claims(self) -> List[tuple]:
        """Per module that ran, in run order: (module, its own parameters, the parameters it claims
        from submodules that never ran, and those submodules (their owners))."""
        ran = self.modules()
        ran_ids = {id(m) for m in ran}
        out = []
        for m in ran:
            claimed, owners = [], []
            stack = list(m.children())
            while stack:
                c = stack.pop()
                if id(c) in ran_ids:
                    continue   # it ran: it waits for its own (and claims its own subtree)
                ps = [p for p in c._parameters.values() if p is not None]
                if ps:
                    claimed += ps
                    owners.append(c)
                stack.extend(c.children())
            own = [p for p in m._parameters.values() if p is not None]
            out.append((m, own, claimed, owners))
        return out

    @staticmethod
    def order(claims: list, buckets_of: Callable[[object], Iterable[int]]) -> list:
        """Buckets in first-use order (``claims`` from :meth:`claims`): each module's own buckets,
        then those it claims."""
        seen: list = []
        known: set = set()
        for _, own, claimed, _ in claims:
            for p in own + claimed:
                for bi in buckets_of(p):
                    if bi not in known:
                        known.add(bi)
                        seen.append(bi)
        return seen
