"""store.py: the public names of the state store. The NVMe/mmap state lives in offload/state/
(tiers) and is driven by offload/engine/engine.py; ``offload.store`` gives users
``StoreFailedError``, ``parse_size`` and the leftover-directory helpers
(offload/state/statedir.py)."""
from .state.tier import StoreFailedError
from .state.statedir import find_stale_state, remove_stale_state
from .base.units import parse_size

__all__ = ["StoreFailedError", "parse_size", "find_stale_state", "remove_stale_state"]
