"""checkpoint.py: streaming, atomic, pickle-free checkpoints of optimizer state.

``save(optimizer, directory)`` writes, per rank, one safetensors-format data file streamed tensor by
tensor in bounded chunks (the header is computed first: every size is known up front) and one small
JSON rank index (step counts, hyperparameters, param-group layout, parameter shapes, a crc32 per
tensor). Then rank 0 commits by atomically replacing ``index.json``, which names the generation of
files that belong together. Every file is written under a temporary name, fsync'ed, renamed, and the
directory fsync'ed, so a crash or ``kill -9`` at any point leaves the previous ``index.json`` and the
files it names untouched: the previous checkpoint still loads. Files of older generations are
deleted only after the commit.

``load(optimizer, directory)`` parses JSON only (never unpickles), checks the layout and every shape
against the optimizer before touching it, verifies every checksum in a first streaming pass, and
then reads the bytes straight into the optimizer's state tensors.

Extension point: an optimizer whose state does not live in plain tensors (e.g. an NVMe store) may
define ``checkpoint_tensors(create: bool) -> list[StateTensor]`` (see :class:`StateTensor`); the
default adapter serves any ``torch.optim.Optimizer`` whose state values are tensors or scalars.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import mmap
import os
import secrets
import struct
import sys
import threading
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

import torch

from ._dist import is_dtensor, like, local, world

__all__ = ["save", "load", "save_async", "SaveHandle", "CheckpointError", "StateTensor"]

FORMAT = "offload-checkpoint"
VERSION = 1
INDEX = "index.json"
DEFAULT_CHUNK = 16 << 20
_MAX_JSON = 64 << 20

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, or does not match the optimizer it is loaded into."""


# ====================================================================== the state interface
@dataclass
class StateTensor:
    """One state tensor as the checkpoint sees it.

    ``read_chunks(n)`` yields contiguous CPU tensors whose bytes, concatenated, are the tensor's
    bytes (each at most ``n`` bytes); ``write_chunks(n)`` is a generator yielding writable CPU
    tensors that the loader fills in order (the generator may flush each one to its store when
    resumed). Neither needs the whole tensor in memory at once.
    """
    name: str
    param: int           # index of the parameter (torch state_dict numbering)
    key: str             # state key, e.g. 'exp_avg'
    dtype: torch.dtype
    shape: tuple
    read_chunks: Callable[[int], Iterator[torch.Tensor]]
    write_chunks: Callable[[int], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()


def _byte_chunks(t: torch.Tensor, n: int) -> Iterator[torch.Tensor]:
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)
    for b in range(0, flat.numel(), n):
        yield flat[b:b + n]


def _tensor_ref(name: str, pidx: int, key: str, t: torch.Tensor) -> StateTensor:
    lt = local(t)
    if lt.device.type != "cpu" or not lt.is_contiguous():
        # state on an accelerator or strided: stream a CPU copy per chunk of rows is not worth it here
        def read(n, lt=lt):
            return _byte_chunks(lt.detach().to("cpu").contiguous(), n)

        def write(n, lt=lt):
            tmp = torch.empty(lt.shape, dtype=lt.dtype)
            yield from _byte_chunks(tmp, n)
            lt.copy_(tmp)
    else:
        def read(n, lt=lt):
            return _byte_chunks(lt.detach(), n)

        def write(n, lt=lt):
            yield from _byte_chunks(lt.detach(), n)
    return StateTensor(name, pidx, key, lt.dtype, tuple(lt.shape), read, write)


def _params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _default_tensors(optimizer, create_from: Optional[dict] = None) -> List[StateTensor]:
    """StateTensors of a torch-style optimizer; with ``create_from`` (rank index), missing state is
    allocated with the saved dtypes/shapes first (loading into a fresh optimizer)."""
    params = _params(optimizer)
    if create_from is not None:
        for rec in create_from["tensors"]:
            p = params[rec["param"]]
            st = optimizer.state[p]
            cur = st.get(rec["key"])
            want_dtype, want_shape = _FROM_ST[rec["dtype"]], tuple(rec["shape"])
            if not (isinstance(cur, torch.Tensor) and local(cur).dtype == want_dtype
                    and tuple(local(cur).shape) == want_shape and local(cur).is_contiguous()):
                lt = torch.empty(want_shape, dtype=want_dtype)
                st[rec["key"]] = like(p, lt) if tuple(local(p).shape) == want_shape else lt
    refs = []
    for pidx, p in enumerate(params):
        st = optimizer.state.get(p)
        if not st:
            continue
        for key in sorted(st):
            v = st[key]
            if key == "step" or not isinstance(v, torch.Tensor):
                continue
            refs.append(_tensor_ref(f"state.{pidx}.{key}", pidx, key, v))
    return refs


def _store_tensors(optimizer) -> List[StateTensor]:
    """StateTensors of an offload optimizer with NVMe/mmap state (offload/store.py): views of the
    mapped state file, streamed chunk by chunk (a parameter split over buckets is joined)."""
    tensors = optimizer._store.state_tensors()
    refs, pidx = [], 0
    for gi, g in enumerate(optimizer.param_groups):
        for i in range(len(g["params"])):
            for key, t in sorted((tensors.get((gi, i)) or {}).items()):
                refs.append(_tensor_ref(f"state.{pidx}.{key}", pidx, key, t))
            pidx += 1
    return refs


def _special_mode(optimizer) -> bool:
    """State the optimizer must load itself (load_state_dict): NVMe/mmap store or GPU-offload engine."""
    return getattr(optimizer, "_store", None) is not None or getattr(optimizer, "_gpu", None) is not None


def _quiesce(optimizer) -> None:
    gpu = getattr(optimizer, "_gpu", None)
    if gpu is not None:
        gpu.synchronize()  # queued CPU steps and uploads done: the host state is settled


def _state_tensors(optimizer, create_from: Optional[dict] = None) -> List[StateTensor]:
    hook = getattr(optimizer, "checkpoint_tensors", None)
    if hook is not None:
        return list(hook(create_from))
    if create_from is None and getattr(optimizer, "_store", None) is not None:
        return _store_tensors(optimizer)
    return _default_tensors(optimizer, create_from)


# ====================================================================== json-able scalars
def _jsonable(v, where: str):
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise CheckpointError(f"{where}: tensor-valued hyperparameters must have one element")
        return {"__tensor__": local(v).item()}
    if isinstance(v, tuple):
        return {"__tuple__": [_jsonable(x, where) for x in v]}
    if isinstance(v, list):
        return [_jsonable(x, where) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise CheckpointError(f"{where}: cannot store a value of type {type(v).__name__} in a checkpoint")


def _unjson(v, current=None):
    if isinstance(v, dict) and "__tensor__" in v:
        if isinstance(current, torch.Tensor):
            current = current.detach().clone()
            current.fill_(v["__tensor__"])
            return current
        return torch.tensor(v["__tensor__"])
    if isinstance(v, dict) and "__tuple__" in v:
        cur = current if isinstance(current, tuple) and len(current) == len(v["__tuple__"]) else (None,) * len(v["__tuple__"])
        return tuple(_unjson(x, c) for x, c in zip(v["__tuple__"], cur))
    if isinstance(v, list):
        return [_unjson(x) for x in v]
    return v


# ====================================================================== file helpers
def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data) -> None:
    mv = memoryview(data).cast("B")
    while len(mv):
        n = os.write(fd, mv)
        if n <= 0:
            raise OSError(f"short write ({n})")
        mv = mv[n:]


def _atomic_write_bytes(directory: str, name: str, data: bytes) -> None:
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, os.path.join(directory, name))
    _fsync_dir(directory)


def _read_json(path: str, what: str) -> tuple:
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_JSON + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} does not exist") from None
    if len(raw) > _MAX_JSON:
        raise CheckpointError(f"{what} {path} is larger than {_MAX_JSON} bytes: not an offload checkpoint")
    try:
        return json.loads(raw.decode("utf-8")), raw
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON ({e}): the file is corrupted or truncated") from None


def _rank_name(rank: int, world_size: int, gen: str, ext: str) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.{gen}.{ext}"


def _progress(total: int, enabled: Optional[bool], desc: str):
    if enabled is False or (enabled is None and (total < (1 << 30) or not sys.stderr.isatty())):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)


# ====================================================================== save
def _resolve(optimizer, group):
    """(the optimizer holding this rank's state, process group). ZeroRedundancyOptimizer: its shard."""
    inner = getattr(optimizer, "optim", None)
    if inner is not None and hasattr(optimizer, "_partition_parameters"):
        return inner, (group if group is not None else getattr(optimizer, "process_group", None))
    return optimizer, group


def _describe(optimizer, refs: List[StateTensor]) -> dict:
    """The rank index (without data offsets/checksums): layout, hyperparameters, steps, tensors."""
    params = _params(optimizer)
    groups, pidx = [], 0
    for gi, g in enumerate(optimizer.param_groups):
        hyper = {k: _jsonable(v, f"param group {gi} '{k}'") for k, v in g.items()
                 if k not in ("params", "param_names")}
        rec = {"hyper": hyper, "params": list(range(pidx, pidx + len(g["params"])))}
        if "param_names" in g:
            rec["param_names"] = list(g["param_names"])
        groups.append(rec)
        pidx += len(g["params"])
    prec = []
    for i, p in enumerate(params):
        lp = local(p)
        st = optimizer.state.get(p) or {}
        extra = {k: _jsonable(v, f"state of parameter {i} '{k}'") for k, v in st.items()
                 if k != "step" and not isinstance(v, torch.Tensor)}
        step = st.get("step")
        prec.append({"shape": list(lp.shape), "dtype": str(lp.dtype).replace("torch.", ""),
                     "global_shape": list(p.shape) if is_dtensor(p) else None,
                     "placements": [str(pl) for pl in p.placements] if is_dtensor(p) else None,
                     "has_state": bool(st),
                     "step": None if step is None else (local(step).item() if isinstance(step, torch.Tensor) else step),
                     "extra": extra})
    return {"optimizer": type(optimizer).__name__, "param_groups": groups, "params": prec,
            "pending_grad_multiplier": float(getattr(optimizer, "_pending_multiplier", 1.0)),
            "tensors": [{"name": r.name, "param": r.param, "key": r.key, "dtype": _ST_DTYPES[r.dtype],
                         "shape": list(r.shape)} for r in refs]}


def _safetensors_header(recs: list) -> bytes:
    header, off = {}, 0
    for r in recs:
        n = r["nbytes"]
        header[r["name"]] = {"dtype": r["dtype"], "shape": r["shape"], "data_offsets": [off, off + n]}
        r["offsets"] = [off, off + n]
        off += n
    header["__metadata__"] = {"format": FORMAT, "version": str(VERSION)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the safetensors writer does
    return struct.pack("<Q", len(raw)) + raw


class _Saver:
    """One save: phase 1 writes this rank's files (any thread); phase 2 commits (collective)."""

    def __init__(self, optimizer, directory, *, group=None, chunk_bytes=DEFAULT_CHUNK, progress=None):
        self.opt, self.group = _resolve(optimizer, group)
        self.dir = os.path.abspath(os.fspath(directory))
        self.rank, self.world = world(self.group)
        self.chunk = int(chunk_bytes)
        if self.chunk < 4096:
            raise ValueError("chunk_bytes must be >= 4096")
        self.progress = progress
        os.makedirs(self.dir, exist_ok=True)
        self.gen = self._generation()
        _quiesce(self.opt)
        self.refs = _state_tensors(self.opt)
        self.desc = _describe(self.opt, self.refs)
        self.rank_index_crc = 0
        self.data_bytes = 0

    def _generation(self) -> str:
        token = secrets.token_hex(8)
        if self.world == 1:
            return token
        import torch.distributed as dist
        t = torch.tensor([int(token[:15], 16)], dtype=torch.int64)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
        return f"{int(t.item()):015x}"

    def write_rank_files(self) -> None:
        d, r, w, gen = self.dir, self.rank, self.world, self.gen
        recs = self.desc["tensors"]
        for rec, ref in zip(recs, self.refs):
            rec["nbytes"] = ref.nbytes
        head = _safetensors_header(recs)
        data_name = _rank_name(r, w, gen, "safetensors")
        tmp = os.path.join(d, f".{data_name}.tmp-{os.getpid()}")
        total = sum(rec["nbytes"] for rec in recs)
        bar = _progress(total, self.progress, f"offload.save rank {r}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, head)
            for rec, ref in zip(recs, self.refs):
                crc, n = 0, 0
                for chunk in ref.read_chunks(self.chunk):
                    buf = chunk.numpy() if chunk.numel() else b""
                    # checksum on a helper thread while this one writes the same bytes (both drop the GIL)
                    fut = _crc_pool().submit(zlib.crc32, buf, crc)
                    _write_all(fd, buf)
                    crc = fut.result()
                    n += chunk.numel()
                    if bar is not None:
                        bar.update(chunk.numel())
                if n != rec["nbytes"]:
                    raise CheckpointError(f"state tensor {rec['name']} produced {n} bytes, expected {rec['nbytes']}")
                rec["crc32"] = crc
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        finally:
            if bar is not None:
                bar.close()
        os.close(fd)
        os.replace(tmp, os.path.join(d, data_name))
        self.data_bytes = len(head) + total
        index = dict(format=FORMAT + "-rank", version=VERSION, rank=r, world_size=w, generation=gen,
                     data_file=data_name, data_bytes=self.data_bytes, header_bytes=len(head), **self.desc)
        raw = json.dumps(index, indent=1).encode()
        self.rank_index_crc = zlib.crc32(raw)
        _atomic_write_bytes(d, _rank_name(r, w, gen, "json"), raw)  # also fsyncs the directory

    def commit(self) -> None:
        """Collective when distributed: gather (crc, size) of every rank's files, rank 0 swaps index.json."""
        sizes = [(self.rank_index_crc, self.data_bytes)]
        if self.world > 1:
            import torch.distributed as dist
            mine = torch.tensor([self.rank_index_crc, self.data_bytes], dtype=torch.int64)
            out = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(out, mine, group=self.group)
            sizes = [(int(t[0]), int(t[1])) for t in out]
        if self.rank == 0:
            ranks = [{"index": _rank_name(r, self.world, self.gen, "json"), "index_crc32": c,
                      "data": _rank_name(r, self.world, self.gen, "safetensors"), "data_bytes": n}
                     for r, (c, n) in enumerate(sizes)]
            index = {"format": FORMAT, "version": VERSION, "generation": self.gen, "world_size": self.world,
                     "ranks": ranks}
            _atomic_write_bytes(self.dir, INDEX, json.dumps(index, indent=1).encode())
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier(group=self.group)
        self._cleanup()

    def _cleanup(self) -> None:
        """After the commit: delete this rank's files of other generations and leftover temporaries;
        rank 0 also deletes files of checkpoints saved with another world size."""
        mine = f"rank{self.rank:05d}-of-"
        keep = {_rank_name(self.rank, self.world, self.gen, ext) for ext in ("json", "safetensors")}
        for name in os.listdir(self.dir):
            base = name.lstrip(".")
            if self.rank == 0 and name.startswith(f".{INDEX}.tmp-"):
                _unlink(os.path.join(self.dir, name))  # an index.json write that was killed
                continue
            if not base.startswith("rank") or name in keep:
                continue
            ours = base.startswith(mine)
            other_world = self.rank == 0 and f"-of-{self.world:05d}." not in base
            if ours or other_world:
                _unlink(os.path.join(self.dir, name))


_crc_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _crc_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _crc_executor
    with _locks_guard:
        if _crc_executor is None:
            _crc_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload-crc")
        return _crc_executor


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def save(optimizer, directory, *, group=None, chunk_bytes: int = DEFAULT_CHUNK, progress: Optional[bool] = None) -> str:
    """Save ``optimizer``'s state into ``directory`` atomically; returns the directory.

    Works for ``offload.Adam/AdamW``, any ``torch.optim`` optimizer with tensor state, and
    ``ZeroRedundancyOptimizer`` (each rank saves its shard). When torch.distributed is
    initialized, every rank of ``group`` must call it (one data file per rank, one index).
    ``progress``: tqdm bar (None: only for saves over 1 GiB on a terminal).
    """
    _wait_pending(optimizer)
    s = _Saver(optimizer, directory, group=group, chunk_bytes=chunk_bytes, progress=progress)
    with _dir_lock(s.dir):
        s.write_rank_files()
        s.commit()
    return s.dir


# ---------------------------------------------------------------------- asynchronous save
_locks: dict = {}
_locks_guard = threading.Lock()


def _dir_lock(d: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(d, threading.Lock())


class SaveHandle:
    """Result of :func:`save_async`: ``result()`` waits (and, when distributed, commits: every rank
    must call it, which the step pre-hook does); ``done()``; ``await handle`` in asyncio code."""

    def __init__(self, saver: _Saver, optimizer):
        self._saver = saver
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._committed = saver.world > 1  # distributed: commit happens in result()
        self._lock = threading.Lock()
        self._result: Optional[str] = None
        self._hook = None
        self._opt = optimizer

    def done(self) -> bool:
        """True once this rank's files are written (distributed: the commit still happens in result())."""
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> str:
        return self._finish(timeout, remove_hook=True)

    def _finish(self, timeout: Optional[float], remove_hook: bool) -> str:
        self._future.result(timeout)
        with self._lock:
            if self._result is None:
                if self._saver.world > 1:
                    with _dir_lock(self._saver.dir):
                        self._saver.commit()
                self._result = self._saver.dir
            # inside step() torch is iterating over the hooks: the spent hook is removed later
            if remove_hook and self._hook is not None:
                self._hook.remove()
                self._hook = None
                if _pending.get(id(self._opt)) is self:
                    del _pending[id(self._opt)]
        return self._result

    def _step_pre_hook(self, *_args, **_kwargs) -> None:
        if self._result is None:
            self._finish(None, remove_hook=False)

    wait = result

    def __await__(self):
        yield from asyncio.wrap_future(self._future).__await__()
        return self.result()


_pending: dict = {}


def _wait_pending(optimizer) -> None:
    h = _pending.get(id(optimizer))
    if h is not None:
        h.result()


def save_async(optimizer, directory, *, group=None, chunk_bytes: int = DEFAULT_CHUNK,
               progress: Optional[bool] = False) -> SaveHandle:
    """Start saving in a background thread and return a :class:`SaveHandle` at once.

    Training may run forward and backward meanwhile; the optimizer's next ``step()`` (the only
    thing that changes the state) waits until the state is written, through a step pre-hook, so
    the checkpoint is never a mix of two steps. Non-distributed saves commit in the background;
    distributed ones commit in ``result()`` (called by that hook on every rank).
    """
    _wait_pending(optimizer)
    if getattr(_resolve(optimizer, group)[0], "_gpu", None) is not None:
        raise NotImplementedError("save_async with GPU offload: the engine may update the state during backward "
                                  "(not only in step()), so a background save could mix two steps; use offload.save")
    saver = _Saver(optimizer, directory, group=group, chunk_bytes=chunk_bytes, progress=progress)
    handle = SaveHandle(saver, optimizer)
    target = saver.opt
    handle._hook = target.register_step_pre_hook(handle._step_pre_hook)
    _pending[id(optimizer)] = handle

    def work():
        try:
            with _dir_lock(saver.dir):
                saver.write_rank_files()
                if saver.world == 1:
                    saver.commit()
            handle._future.set_result(saver.dir)
        except BaseException as e:  # delivered by result()
            handle._future.set_exception(e)

    threading.Thread(target=work, name="offload-save", daemon=True).start()
    return handle


# ====================================================================== load
def _check_crc(path: str, f, rec: dict, buf: bytearray, base: int) -> None:
    f.seek(base + rec["offsets"][0])
    left, crc = rec["offsets"][1] - rec["offsets"][0], 0
    mv = memoryview(buf)
    while left:
        n = f.readinto(mv[:min(left, len(buf))])
        if not n:
            raise CheckpointError(f"{path} is truncated (tensor {rec['name']} ends early)")
        crc = zlib.crc32(mv[:n], crc)
        left -= n
    if crc != rec["crc32"]:
        raise CheckpointError(f"checksum mismatch in {path} for tensor {rec['name']} "
                              f"(stored crc32 {rec['crc32']:08x}, file has {crc:08x}): the file is corrupted")


def _read_rank(directory: str, rank: int, world_size: int) -> tuple:
    index, _ = _read_json(os.path.join(directory, INDEX), "checkpoint index")
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{directory}/{INDEX} is not an offload checkpoint index")
    if index.get("version") != VERSION:
        raise CheckpointError(f"checkpoint format version {index.get('version')} is not supported (this is {VERSION})")
    if index["world_size"] != world_size:
        raise CheckpointError(f"checkpoint in {directory} was saved by {index['world_size']} rank(s); it is being "
                              f"loaded by {world_size}: each rank loads its own shard, so the world size must match")
    entry = index["ranks"][rank]
    rpath = os.path.join(directory, entry["index"])
    ridx, raw = _read_json(rpath, "rank index")
    if zlib.crc32(raw) != entry["index_crc32"]:
        raise CheckpointError(f"checksum mismatch for {rpath}: the rank index is corrupted")
    dpath = os.path.join(directory, entry["data"])
    try:
        size = os.path.getsize(dpath)
    except FileNotFoundError:
        raise CheckpointError(f"data file {dpath} named by the index does not exist") from None
    if size != entry["data_bytes"] or size != ridx["data_bytes"]:
        raise CheckpointError(f"{dpath} has {size} bytes, the index says {entry['data_bytes']}: "
                              "the file is truncated or corrupted")
    return ridx, dpath


def _check_header(f, dpath: str, ridx: dict) -> int:
    """Parse the safetensors header (JSON only) and cross-check it with the rank index."""
    head = f.read(8)
    if len(head) != 8:
        raise CheckpointError(f"{dpath} is truncated")
    (n,) = struct.unpack("<Q", head)
    if n != ridx["header_bytes"] - 8:
        raise CheckpointError(f"{dpath}: header size {n} does not match the index: the file is corrupted")
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{dpath}: the safetensors header is corrupted") from None
    for rec in ridx["tensors"]:
        h = header.get(rec["name"])
        if h != {"dtype": rec["dtype"], "shape": rec["shape"], "data_offsets": rec["offsets"]}:
            raise CheckpointError(f"{dpath}: header entry for {rec['name']} disagrees with the index: corrupted")
    return 8 + n


def _check_layout(opt, ridx: dict, directory: str) -> None:
    groups = opt.param_groups
    saved = ridx["param_groups"]
    if len(groups) != len(saved):
        raise CheckpointError(f"checkpoint {directory} has {len(saved)} param group(s); the optimizer has {len(groups)}")
    for gi, (g, sg) in enumerate(zip(groups, saved)):
        if len(g["params"]) != len(sg["params"]):
            raise CheckpointError(f"param group {gi}: checkpoint has {len(sg['params'])} parameters, the optimizer "
                                  f"has {len(g['params'])}")
    for i, (p, rec) in enumerate(zip(_params(opt), ridx["params"])):
        lp = local(p)
        if list(lp.shape) != rec["shape"] or (is_dtensor(p) and rec["global_shape"] not in (None, list(p.shape))):
            saved_shape = rec["global_shape"] or rec["shape"]
            raise CheckpointError(f"parameter {i}: checkpoint was saved for shape {tuple(saved_shape)}"
                                  f"{' (local ' + str(tuple(rec['shape'])) + ')' if rec['global_shape'] else ''}, "
                                  f"but the model's parameter has shape {tuple(p.shape)}"
                                  f"{' (local ' + str(tuple(lp.shape)) + ')' if is_dtensor(p) else ''}: "
                                  "refusing to load into a different model")
    for rec in ridx["tensors"]:
        if rec["dtype"] not in _FROM_ST:
            raise CheckpointError(f"tensor {rec['name']} has unsupported dtype {rec['dtype']}")


def load(optimizer, directory, *, group=None, chunk_bytes: int = DEFAULT_CHUNK, verify: bool = True) -> None:
    """Load a checkpoint written by :func:`save` into ``optimizer`` (same layout and shapes).

    Restores state tensors, step counts and hyperparameters (like ``load_state_dict``). Nothing is
    changed unless the layout, shapes and (with ``verify``) every checksum are right.
    """
    _wait_pending(optimizer)
    opt, group = _resolve(optimizer, group)
    directory = os.path.abspath(os.fspath(directory))
    rank, world_size = world(group)
    ridx, dpath = _read_rank(directory, rank, world_size)
    _check_layout(opt, ridx, directory)
    buf = bytearray(min(int(chunk_bytes), max([r["offsets"][1] - r["offsets"][0] for r in ridx["tensors"]] + [1])))
    with open(dpath, "rb") as f:
        base = _check_header(f, dpath, ridx)
        if verify:
            for rec in ridx["tensors"]:
                _check_crc(dpath, f, rec, buf, base)
        if _special_mode(opt):
            _load_via_state_dict(opt, ridx, f, base)
            _finish_load(optimizer, opt, ridx)
            return
        # ---- from here on the optimizer is modified
        params = _params(opt)
        saved_keys: dict = {}
        for rec in ridx["tensors"]:
            saved_keys.setdefault(rec["param"], set()).add(rec["key"])
        for i, (p, prec) in enumerate(zip(params, ridx["params"])):
            if not prec["has_state"]:
                opt.state.pop(p, None)
                continue
            st = opt.state[p]
            for k in [k for k in st if k not in saved_keys.get(i, ()) and k != "step"]:
                del st[k]  # e.g. max_exp_avg_sq of a run with amsgrad, loading a run without
            if prec["step"] is not None:
                st["step"] = torch.tensor(float(prec["step"]), dtype=torch.float32)
            for k, v in prec["extra"].items():
                st[k] = _unjson(v)
        refs = {r.name: r for r in _state_tensors(opt, create_from=ridx)}
        for rec in ridx["tensors"]:
            ref = refs.get(rec["name"])
            if ref is None or ref.dtype != _FROM_ST[rec["dtype"]] or list(ref.shape) != rec["shape"]:
                raise CheckpointError(f"optimizer could not provide a destination for {rec['name']}")
            f.seek(base + rec["offsets"][0])
            crc = 0
            for dst in ref.write_chunks(int(chunk_bytes)):
                mv = memoryview(dst.numpy()) if dst.numel() else memoryview(b"")
                got = f.readinto(mv) if len(mv) else 0
                if got != len(mv):
                    raise CheckpointError(f"{dpath} is truncated (tensor {rec['name']}); optimizer state is now partial")
                crc = zlib.crc32(mv, crc)
            if verify and crc != rec["crc32"]:
                raise CheckpointError(f"{dpath} changed while loading (tensor {rec['name']}); optimizer state is now partial")
    for g, sg in zip(opt.param_groups, ridx["param_groups"]):
        for k, v in sg["hyper"].items():
            g[k] = _unjson(v, g.get(k))
    # let the optimizer re-adopt its state (offload re-reads pointers and step counters here)
    opt.__setstate__({"state": opt.state, "param_groups": opt.param_groups})
    _finish_load(optimizer, opt, ridx)


def _load_via_state_dict(opt, ridx: dict, f, base: int) -> None:
    """NVMe/mmap store or GPU engine: hand ``load_state_dict`` tensors that are views of a private
    mapping of the (verified) checkpoint file, so the store streams them bucket by bucket into its
    own file without the whole state ever being copied into RAM."""
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: nothing is written back
    state: dict = {}
    for i, prec in enumerate(ridx["params"]):
        if prec["has_state"]:
            st = {k: _unjson(v) for k, v in prec["extra"].items()}
            if prec["step"] is not None:
                st["step"] = torch.tensor(float(prec["step"]), dtype=torch.float32)
            state[i] = st
    for rec in ridx["tensors"]:
        dtype, shape = _FROM_ST[rec["dtype"]], rec["shape"]
        count = (rec["offsets"][1] - rec["offsets"][0]) // torch.empty((), dtype=dtype).element_size()
        t = (torch.frombuffer(mm, dtype=dtype, count=count, offset=base + rec["offsets"][0]).view(shape)
             if count else torch.empty(shape, dtype=dtype))
        state.setdefault(rec["param"], {})[rec["key"]] = t
    groups = [dict({k: _unjson(v, g.get(k)) for k, v in sg["hyper"].items()}, params=list(sg["params"]))
              for g, sg in zip(opt.param_groups, ridx["param_groups"])]
    opt.load_state_dict({"state": state, "param_groups": groups})
    # the views die with ``state``; the mapping closes when the last one is gone


def _finish_load(optimizer, opt, ridx: dict) -> None:
    if opt is not optimizer and hasattr(optimizer, "_sync_param_groups"):
        # ZeroRedundancyOptimizer copies its own groups' hyperparameters into the shard's at every
        # step: give it the loaded ones (groups correspond by index)
        optimizer._sync_param_groups(opt.param_groups, optimizer.param_groups)
    if hasattr(opt, "_pending_multiplier"):
        opt._pending_multiplier = float(ridx.get("pending_grad_multiplier", 1.0))
