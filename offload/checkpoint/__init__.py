"""offload.checkpoint: streaming, atomic, pickle-free checkpoints of optimizer state.

``save(optimizer, directory)`` writes, per rank, one safetensors data file and one JSON rank
index, then commits by atomically replacing ``index.json``; ``load`` validates everything against
the optimizer before changing it; ``save_async`` saves in a background thread. Modules:
format.py (on-disk format, file primitives), adapter.py (the optimizer-side extension point),
save.py, validate.py, load.py, pending.py + async_.py (background saves). See docs/checkpoints.md.
"""
from .adapter import StateTensor
from .async_ import SaveHandle, save_async
# (constants kept public)
from .format import DEFAULT_CHUNK, FORMAT, INDEX, VERSION, CheckpointError  # noqa: F401
from .load import load
from .save import save

__all__ = ["save", "load", "save_async", "SaveHandle", "CheckpointError", "StateTensor"]
