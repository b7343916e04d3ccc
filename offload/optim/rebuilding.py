"""optim/rebuilding.py: ``EngineSync``, the part of offload.Adam/AdamW (optim/adam.py) that
keeps its state engine (``_engine``) laid out for the param groups as they are: where a group's
params list (or, at a step, its amsgrad) changed, the engine is built again holding what
``opt.state`` holds (optim/engine_slot.py, offload/engine/rebuild.py), and the optimizer's face
(optim/faces.py) steps it from then on (``restart``: a device schedule is made again over it).
"""
from __future__ import annotations

from typing import Optional

from .checks import check_amsgrad, param_name

__all__ = ["EngineSync"]


class EngineSync:
    def _sync_engine(self, native: Optional[list] = None, stepping: bool = False) -> None:
        """Make the engine hold the param groups as they are (optim/engine_slot.py)."""
        native = self._slot.groups(self.param_groups, self._router) if native is None else native
        if self._slot.stale(self._engine, native, stepping):
            for gi, g in enumerate(native):   # (amsgrad switched on: refused before any change)
                check_amsgrad(g, gi, self.moments)
            self.state.update(self._rebuild_engine(native, self.state))
            self._face.load_state()

    def _rebuild_engine(self, native: list, state) -> dict:
        """A new engine for ``native`` holding ``state`` (raises before any change): the state's
        views. The face is told first (device parameters: the last step lands; refused between a
        backward and its step()), and steps the new engine from then on."""
        self._face.before_rebuild()
        names = lambda gi, i: param_name(self.param_groups, gi, i)   # noqa: E731
        engine, views = self._slot.rebuild(native, state, names, self._engine)
        old, self._engine = self._engine, engine
        self._face.restart(engine)
        if old is not None:
            old.close()
        return views
