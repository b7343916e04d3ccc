"""store.py: compatibility face. The NVMe/mmap state lives in offload/state/ (tiers) and is driven by
offload/engine/engine.py; ``offload.store.StoreFailedError``, ``parse_size`` and the leftover-directory
helpers (offload/state/statedir.py) stay importable here."""
from .state.files import make_private_dir as _make_private_dir  # noqa: F401 (tests patch it)
from .state import statedir  # noqa: F401
from .state.tier import StoreFailedError
from .state.statedir import STATE_FILE, find_stale_state, remove_stale_state  # noqa: F401
from .base.units import parse_size

__all__ = ["StoreFailedError", "parse_size", "find_stale_state", "remove_stale_state"]
