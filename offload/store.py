"""store.py: compatibility face. The NVMe/mmap state now lives in offload/state/ (tiers) and is driven
by offload/step/engine.py; ``offload.store.StoreFailedError`` and ``parse_size`` stay importable here."""
from .state.files import STATE_FILE, make_private_dir as _make_private_dir  # noqa: F401 (tests patch it)
from .state.tier import StoreFailedError
from .units import parse_size

__all__ = ["StoreFailedError", "parse_size"]
