"""checkpoint/format.py: the on-disk format of offload checkpoints and the file primitives.

Everything here is independent of optimizers: file-name patterns and their validation, dtype tags,
the safetensors header, strict JSON decoding of hyperparameter values, reading regular files only
(never following a symlink, never blocking on a FIFO), atomic no-overwrite writes, and the
per-save *intent* manifest that lists every file a save may create (the only files a later save
is allowed to delete).
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import stat
import struct
from typing import Optional

import torch

FORMAT = "offload-checkpoint"
VERSION = 1
INDEX = "index.json"
DEFAULT_CHUNK = 16 << 20
MAX_JSON = 64 << 20
MAX_DEPTH = 32


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, or does not match the optimizer it is loaded into."""


# ---------------------------------------------------------------------------------- dtypes
# rank-index tag -> torch dtype. The rank index names the tensor's real dtype; the safetensors
# header names how it is stored (complex128/complex32 have no safetensors tag: stored as their
# real view, a float tensor with a trailing dimension of 2).
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8,
          "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
          "C64": torch.complex64, "C128": torch.complex128, "C32": torch.complex32}
TAGS = {v: k for k, v in DTYPES.items()}
_AS_REAL = {"C128": "F64", "C32": "F16"}


def dtype_tag(dtype: torch.dtype, where: str) -> str:
    tag = TAGS.get(dtype)
    if tag is None:
        raise CheckpointError(f"{where}: state tensors of dtype {dtype} cannot be stored "
                              "in a checkpoint")
    return tag


def file_layout(tag: str, shape: list) -> tuple:
    """(safetensors dtype tag, shape) under which a tensor of rank-index ``tag`` is stored."""
    if tag in _AS_REAL:
        return _AS_REAL[tag], list(shape) + [2]
    return tag, list(shape)


def element_size(tag: str) -> int:
    return torch.empty((), dtype=DTYPES[tag]).element_size()


# ---------------------------------------------------------------------------------- names
GEN = r"[0-9a-f]{15,16}"
_RANK = rf"rank(\d{{5}})-of-(\d{{5}})\.({GEN})\.(json|safetensors)"
_INTENT = rf"\.rank(\d{{5}})-of-(\d{{5}})\.({GEN})\.intent"
RANK_RE = re.compile(_RANK + r"\Z")
INTENT_RE = re.compile(_INTENT + r"\Z")
TMP_RE = re.compile(rf"\.({_RANK}|{re.escape(INDEX)})\.tmp-\d+-[0-9a-f]{{8}}\Z")
GEN_RE = re.compile(GEN + r"\Z")


def rank_name(rank: int, world_size: int, gen: str, ext: str) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.{gen}.{ext}"


def intent_name(rank: int, world_size: int, gen: str) -> str:
    return f".rank{rank:05d}-of-{world_size:05d}.{gen}.intent"


def tmp_name(final: str) -> str:
    return f".{final}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def generation_of(name: str) -> Optional[str]:
    """The generation token of one of our generated names (None for anything else)."""
    for rx in (RANK_RE, INTENT_RE):
        m = rx.match(name)
        if m:
            return m.group(3)
    m = TMP_RE.match(name)
    if m and m.group(1) != INDEX:
        return RANK_RE.match(m.group(1)).group(3)
    return None


def check_plain_name(name, what: str) -> str:
    """A plain file name inside the checkpoint directory: no separator, no '..', not absolute, no
    NUL."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name or os.sep in name or (os.altsep and os.altsep in name)):
        raise CheckpointError(f"{what} names {name!r}, which is not a plain file name inside the "
                              "checkpoint directory: refusing to follow it (the index is "
                              "corrupted or crafted)")
    return name


# ---------------------------------------------------------------------------------- files
def fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data) -> None:
    mv = memoryview(data).cast("B")
    while len(mv):
        n = os.write(fd, mv)
        if n <= 0:
            raise OSError(f"short write ({n})")
        mv = mv[n:]


def create_new(directory: str, name: str) -> int:
    """Open a new file for writing; never replaces or follows an existing file or link."""
    return os.open(os.path.join(directory, name),
                   os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def atomic_write_bytes(directory: str, name: str, data: bytes, tmp: Optional[str] = None) -> None:
    tmp = tmp or tmp_name(name)
    fd = create_new(directory, tmp)
    try:
        write_all(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink(os.path.join(directory, tmp))
        raise
    os.close(fd)
    os.replace(os.path.join(directory, tmp), os.path.join(directory, name))
    fsync_dir(directory)


def open_regular(directory: str, name: str, what: str) -> int:
    """fd of ``directory/name`` opened read-only: a regular file, not a symlink, never blocking
    (FIFO)."""
    check_plain_name(name, what)
    path = os.path.join(directory, name)
    flags = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
             | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} does not exist") from None
    except OSError as e:
        if os.path.islink(path):
            raise CheckpointError(f"{what} {path} is a symbolic link: refusing to follow it out "
                                  "of the checkpoint directory (copy the "
                                  "file in instead)") from None
        raise CheckpointError(f"cannot open {what} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{what} {path} is not a regular file (a FIFO, device or "
                                  "directory): not an offload checkpoint")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def decode_json(raw: bytes, what: str):
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        raise CheckpointError(f"{what} is not valid JSON ({type(e).__name__}: {str(e)[:200]}): "
                              "the file is corrupted or truncated") from None


def read_json(directory: str, name: str, what: str, limit: int = MAX_JSON) -> tuple:
    """(parsed JSON, raw bytes) of a small regular file in ``directory``."""
    fd = open_regular(directory, name, what)
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read {what} "
                              f"{os.path.join(directory, name)}: {e.strerror}") from None
    if len(raw) > limit:
        raise CheckpointError(f"{what} {os.path.join(directory, name)} is larger than {limit} "
                              "bytes: not an offload checkpoint")
    return decode_json(raw, f"{what} {os.path.join(directory, name)}"), raw


# ---------------------------------------------------------------------------------- safetensors
def safetensors_header(recs: list) -> bytes:
    """Header for records with 'name', 'dtype' (rank-index tag), 'shape', 'nbytes'; sets
    'offsets'."""
    header, off = {}, 0
    for r in recs:
        n = r["nbytes"]
        st_dtype, st_shape = file_layout(r["dtype"], r["shape"])
        header[r["name"]] = {"dtype": st_dtype, "shape": st_shape, "data_offsets": [off, off + n]}
        r["offsets"] = [off, off + n]
        off += n
    header["__metadata__"] = {"format": FORMAT, "version": str(VERSION)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the safetensors writer does
    return struct.pack("<Q", len(raw)) + raw


# ---------------------------------------------------------------------------------- values
def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def jsonable(v, where: str, depth: int = 0):
    if depth > MAX_DEPTH:
        raise CheckpointError(f"{where}: value nested too deeply to store in a checkpoint")
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise CheckpointError(f"{where}: tensor-valued hyperparameters must have one element")
        x = (v.detach().cpu().reshape(()).item() if not hasattr(v, "to_local")
             else v.to_local().item())
        if isinstance(x, complex):
            raise CheckpointError(f"{where}: complex-valued hyperparameters cannot be stored")
        return {"__tensor__": x}
    if isinstance(v, tuple):
        return {"__tuple__": [jsonable(x, where, depth + 1) for x in v]}
    if isinstance(v, list):
        return [jsonable(x, where, depth + 1) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise CheckpointError(f"{where}: cannot store a value of type {type(v).__name__} "
                          "in a checkpoint")


def decode_value(v, where: str, depth: int = 0):
    """Strictly decode a stored value into (kind, python value) without creating tensors yet:
    returns a 'spec' that :func:`build_value` turns into the value. Raises CheckpointError."""
    if depth > MAX_DEPTH:
        raise CheckpointError(f"{where}: value nested too deeply")
    if isinstance(v, dict):
        if set(v) == {"__tensor__"}:
            x = v["__tensor__"]
            if not (is_number(x) or isinstance(x, bool)):
                raise CheckpointError(f"{where}: a tensor value must be a number, got {x!r}")
            return ("tensor", x)
        if set(v) == {"__tuple__"} and isinstance(v["__tuple__"], list):
            return ("tuple", [decode_value(x, where, depth + 1) for x in v["__tuple__"]])
        raise CheckpointError(f"{where}: unexpected stored object {str(v)[:80]}")
    if isinstance(v, list):
        return ("list", [decode_value(x, where, depth + 1) for x in v])
    if v is None or isinstance(v, (bool, int, float, str)):
        return ("plain", v)
    raise CheckpointError(f"{where}: unexpected stored value {v!r}")


def check_compatible(spec, current, where: str) -> None:
    """A stored value replacing ``current`` must be of the same kind (number for number, bool for
    bool, tuple of the same length, ...): a checkpoint cannot turn ``lr`` into a string."""
    kind, x = spec
    if current is None or isinstance(current, str) and kind == "plain" and isinstance(x, str):
        return
    bad = CheckpointError(f"{where}: the checkpoint stores {_show(spec)}, the optimizer has "
                          f"{type(current).__name__} {current!r}: refusing a value "
                          "of another kind")
    if isinstance(current, bool):
        if not (kind == "plain" and isinstance(x, bool)):
            raise bad
    elif isinstance(current, (int, float, torch.Tensor)):
        if isinstance(current, torch.Tensor) and current.numel() != 1:
            return
        if not ((kind in ("plain", "tensor")) and is_number(x)):
            raise bad
        if isinstance(x, float) and math.isnan(x) and not (isinstance(current, float)
                                                           and math.isnan(current)):
            raise bad
    elif isinstance(current, (tuple, list)):
        if kind not in ("tuple", "list") or len(x) != len(current):
            raise bad
        for i, (s, c) in enumerate(zip(x, current)):
            check_compatible(s, c, f"{where}[{i}]")
    elif isinstance(current, str):
        raise bad


def _show(spec) -> str:
    kind, x = spec
    if kind in ("tuple", "list"):
        return f"a {kind} of {len(x)}"
    return f"{type(x).__name__} {x!r}"[:80]


def build_value(spec, current=None):
    kind, x = spec
    if kind == "tensor":
        if isinstance(current, torch.Tensor) and current.numel() == 1:
            out = current.detach().clone()
            out.fill_(x)
            return out
        return torch.tensor(x)
    if kind == "tuple":
        cur = (current if isinstance(current, tuple) and len(current) == len(x)
               else (None,) * len(x))
        return tuple(build_value(s, c) for s, c in zip(x, cur))
    if kind == "list":
        return [build_value(s) for s in x]
    return x
