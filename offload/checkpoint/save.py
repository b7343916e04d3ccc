"""checkpoint/save.py: ``offload.save`` - one rank's files written atomically, then the commit.

Per rank, one safetensors data file streamed tensor by tensor in bounded chunks (the header is
computed first) and one JSON rank index (layout, hyperparameters, steps, crc32 per tensor). Rank 0
then commits by atomically replacing ``index.json``. Before writing anything, each rank writes an
*intent* manifest naming every file this save may create; after the commit, a save deletes only
files that match the exact generated-name patterns AND are named by the previous ``index.json``
or by an intent manifest of another generation. No file offload did not create is ever deleted
or overwritten (a foreign ``index.json`` makes the save refuse).
"""
from __future__ import annotations

import json
import os
import queue
import secrets
import sys
import threading
import zlib
from typing import List, Optional

import torch

from ..base.dist import is_dtensor, local, world
from ..moments.format import CODE_VERSIONS, parse_saved_key
from . import adapter
from .format import (DEFAULT_CHUNK, FORMAT, INDEX, INTENT_RE, RANK_RE, TMP_RE, VERSION,
                     CheckpointError, GEN_RE,
                     atomic_write_bytes, create_new, dtype_tag, fsync_dir, generation_of,
                     intent_name,
                     jsonable, rank_name, read_json, safetensors_header, tmp_name, unlink,
                     write_all)

INTENT_FORMAT = FORMAT + "-intent"


def _progress(total: int, enabled: Optional[bool], desc: str):
    if enabled is False or (enabled is None and (total < (1 << 30) or not sys.stderr.isatty())):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)


class _Crc:
    """crc32 on a helper thread of this save while the caller writes the same bytes (both drop the
    GIL). Its own thread, not a shared executor: it must keep working during interpreter exit."""

    def __init__(self):
        self._in: queue.SimpleQueue = queue.SimpleQueue()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="offload-crc", daemon=True)
        self._t.start()

    def _run(self):
        while True:
            job = self._in.get()
            if job is None:
                return
            try:
                self._out.put(zlib.crc32(*job))
            except BaseException as e:  # pragma: no cover - crc32 of a buffer does not fail
                self._out.put(e)

    def submit(self, buf, crc):
        self._in.put((buf, crc))

    def result(self) -> int:
        r = self._out.get()
        if isinstance(r, BaseException):
            raise r
        return r

    def close(self):
        self._in.put(None)


def describe(opt, sd_state: dict, refs: List[adapter.StateTensor]) -> dict:
    """The rank index (without data offsets/checksums): layout, hyperparameters, steps, tensors."""
    ps = adapter.params(opt)
    groups, pidx = [], 0
    for gi, g in enumerate(opt.param_groups):
        hyper = {k: jsonable(v, f"param group {gi} '{k}'") for k, v in g.items()
                 if k not in ("params", "param_names")}
        rec = {"hyper": hyper, "params": list(range(pidx, pidx + len(g["params"])))}
        if "param_names" in g:
            rec["param_names"] = [str(n) for n in g["param_names"]]
        groups.append(rec)
        pidx += len(g["params"])
    prec = []
    for i, p in enumerate(ps):
        lp = local(p)
        st = sd_state.get(i) or {}
        extra = {str(k): jsonable(v, f"state of parameter {i} '{k}'") for k, v in st.items()
                 if k != "step" and not isinstance(v, torch.Tensor)}
        step = st.get("step")
        if isinstance(step, torch.Tensor):
            step = local(step).item()
        prec.append({"shape": list(lp.shape), "dtype": str(lp.dtype).replace("torch.", ""),
                     "global_shape": list(p.shape) if is_dtensor(p) else None,
                     "placements": [str(pl) for pl in p.placements] if is_dtensor(p) else None,
                     "has_state": bool(st), "step": step, "extra": extra})
    # compressed moments: the byte code they were written with (offload/moments/format.py)
    packed_formats = {k[1] for k in map(parse_saved_key, (r.key for r in refs)) if k}
    return {"optimizer": type(opt).__name__, "optimizer_kind": adapter.kind(opt),
            "param_groups": groups,
            "params": prec, "pending_grad_multiplier": adapter.pending_multiplier(opt),
            "tensors": [{"name": r.name, "param": r.param, "key": r.key,
                         "dtype": dtype_tag(r.dtype, f"state tensor {r.name}"),
                         "shape": list(r.shape)}
                        for r in refs],
            "moment_codes": {f: CODE_VERSIONS[f] for f in sorted(packed_formats)}}


def previous_index(directory: str) -> Optional[dict]:
    """The committed index.json in ``directory`` (None if there is none). A file of that name
    that offload did not write makes the save refuse: it would be overwritten."""
    path = os.path.join(directory, INDEX)
    if not os.path.lexists(path):
        return None
    try:
        index, _ = read_json(directory, INDEX, "checkpoint index")
    except CheckpointError as e:
        index, err = None, str(e)
    else:
        err = ""
    if not (isinstance(index, dict) and index.get("format") == FORMAT):
        raise CheckpointError(f"{path} exists and is not an offload checkpoint index "
                              f"({err or 'other content'}): refusing to overwrite a file offload "
                              "did not create; save into another directory or move that file away")
    return index


class Saver:
    """One save: phase 1 writes this rank's files (any thread); phase 2 commits (collective). Holds
    only what the save needs (state tensor references, the description), not the optimizer."""

    def __init__(self, optimizer, directory, *, group=None, chunk_bytes: int, progress=None):
        opt, self.group = adapter.resolve(optimizer, group)
        self.dir = os.path.abspath(os.fspath(directory))
        self.rank, self.world = world(self.group)
        self.chunk = int(chunk_bytes)
        if self.chunk < 4096:
            raise ValueError("chunk_bytes must be >= 4096")
        self.progress = progress
        os.makedirs(self.dir, exist_ok=True)
        self.previous = previous_index(self.dir)
        self.gen = self._generation()
        # state_dict() also settles a device schedule
        sd_state, self.refs = adapter.saved_state(opt)
        self.desc = describe(opt, sd_state, self.refs)
        self.rank_index_crc = 0
        self.data_bytes = 0
        r, w, g = self.rank, self.world, self.gen
        self.data_name, self.index_name = (rank_name(r, w, g, "safetensors"),
                                           rank_name(r, w, g, "json"))
        self.intent = intent_name(r, w, g)
        self.tmps = {n: tmp_name(n) for n in (self.data_name, self.index_name)}
        if self.rank == 0:
            self.tmps[INDEX] = tmp_name(INDEX)

    def _generation(self) -> str:
        token = secrets.token_hex(8)
        if self.world == 1:
            return token
        import torch.distributed as dist
        t = torch.tensor([int(token[:15], 16)], dtype=torch.int64)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                       group=self.group)
        return f"{int(t.item()):015x}"

    def release(self) -> None:
        """Drop the references to the optimizer's state once the files are written."""
        self.refs = []

    def _write_intent(self) -> None:
        files = [self.intent, self.data_name, self.index_name] + list(self.tmps.values())
        # the generation this save supersedes is named too: a save killed after its commit but
        # before it deleted that generation leaves it to the next save to remove
        old_gen, old_files = self._superseded()
        raw = json.dumps({"format": INTENT_FORMAT, "version": VERSION, "rank": self.rank,
                          "world_size": self.world, "generation": self.gen, "files": files,
                          "supersedes": {"generation": old_gen, "files": old_files}}).encode()
        fd = create_new(self.dir, self.intent)
        try:
            write_all(fd, raw)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.dir)

    def write_rank_files(self) -> None:
        d = self.dir
        # again, under the directory lock: the generation to delete after the commit is the one
        # committed when this save really starts (another save into d may have run meanwhile)
        self.previous = previous_index(d)
        recs = self.desc["tensors"]
        for rec, ref in zip(recs, self.refs):
            rec["nbytes"] = ref.nbytes
        head = safetensors_header(recs)
        for name in (self.data_name, self.index_name):
            if os.path.lexists(os.path.join(d, name)):
                raise CheckpointError(f"{os.path.join(d, name)} already exists: refusing "
                                      "to overwrite it")
        self._write_intent()
        tmp = self.tmps[self.data_name]
        total = sum(rec["nbytes"] for rec in recs)
        bar = _progress(total, self.progress, f"offload.save rank {self.rank}")
        fd = create_new(d, tmp)
        crc_worker = _Crc()
        try:
            write_all(fd, head)
            for rec, ref in zip(recs, self.refs):
                crc, n = 0, 0
                for chunk in ref.read_chunks(self.chunk):
                    buf = chunk.numpy() if chunk.numel() else b""
                    crc_worker.submit(buf, crc)
                    write_all(fd, buf)
                    crc = crc_worker.result()
                    n += chunk.numel()
                    if bar is not None:
                        bar.update(chunk.numel())
                if n != rec["nbytes"]:
                    raise CheckpointError(f"state tensor {rec['name']} produced {n} bytes, "
                                          f"expected {rec['nbytes']}")
                rec["crc32"] = crc
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            unlink(os.path.join(d, tmp))
            raise
        finally:
            crc_worker.close()
            if bar is not None:
                bar.close()
        os.close(fd)
        os.replace(os.path.join(d, tmp), os.path.join(d, self.data_name))
        self.data_bytes = len(head) + total
        index = dict(format=FORMAT + "-rank", version=VERSION, rank=self.rank,
                     world_size=self.world,
                     generation=self.gen, data_file=self.data_name, data_bytes=self.data_bytes,
                     header_bytes=len(head), **self.desc)
        raw = json.dumps(index, indent=1).encode()
        self.rank_index_crc = zlib.crc32(raw)
        # also fsyncs the directory
        atomic_write_bytes(d, self.index_name, raw, self.tmps[self.index_name])

    def commit(self) -> None:
        """Collective when distributed: gather (crc, size) of every rank's files, rank 0 swaps
        index.json."""
        sizes = [(self.rank_index_crc, self.data_bytes)]
        if self.world > 1:
            import torch.distributed as dist
            mine = torch.tensor([self.rank_index_crc, self.data_bytes], dtype=torch.int64)
            out = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(out, mine, group=self.group)
            sizes = [(int(t[0]), int(t[1])) for t in out]
        if self.rank == 0:
            # still ours (nobody put a foreign index.json there meanwhile)
            previous_index(self.dir)
            ranks = [{"index": rank_name(r, self.world, self.gen, "json"), "index_crc32": c,
                      "data": rank_name(r, self.world, self.gen, "safetensors"), "data_bytes": n}
                     for r, (c, n) in enumerate(sizes)]
            index = {"format": FORMAT, "version": VERSION, "generation": self.gen,
                     "world_size": self.world, "ranks": ranks}
            atomic_write_bytes(self.dir, INDEX, json.dumps(index, indent=1).encode(),
                               self.tmps[INDEX])
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier(group=self.group)
        self.cleanup()

    def abandon(self) -> None:
        """A failed, uncommitted save: remove what it created (all named by its own intent)."""
        if self.world == 1:
            _remove_listed(self.dir, self.intent, self.gen, skip_gen=None, superseded=False)

    def _superseded(self) -> tuple:
        """(generation, file names) of this rank's files in the previous committed index, if any:
        only names that match our exact patterns and carry that index's generation."""
        prev = self.previous
        if not (isinstance(prev, dict) and isinstance(prev.get("ranks"), list) and
                isinstance(prev.get("generation"), str) and GEN_RE.match(prev["generation"]) and
                prev["generation"] != self.gen):
            return None, []
        pw, names = prev.get("world_size"), []
        for r, entry in enumerate(prev["ranks"]):
            if not isinstance(entry, dict) or not (r == self.rank and pw == self.world
                                                   or self.rank == 0
                                                   and pw != self.world):
                continue
            for key in ("index", "data"):
                name = entry.get(key)
                if (isinstance(name, str) and RANK_RE.match(name)
                    and generation_of(name) == prev["generation"]):
                    names.append(name)
        return prev["generation"], names

    def cleanup(self) -> None:
        """After the commit: delete files of other generations, but only names that match our exact
        patterns and that the previous index or an intent manifest lists."""
        for name in self._superseded()[1]:
            unlink(os.path.join(self.dir, name))
        for name in os.listdir(self.dir):
            m = INTENT_RE.match(name)
            if not m or m.group(3) == self.gen:
                continue
            r, w = int(m.group(1)), int(m.group(2))
            if (r == self.rank and w == self.world) or (self.rank == 0 and w != self.world):
                _remove_listed(self.dir, name, m.group(3), skip_gen=self.gen, superseded=True)
        # this generation is committed: nothing left to undo
        unlink(os.path.join(self.dir, self.intent))


def _remove_listed(directory: str, intent: str, gen: str, skip_gen: Optional[str],
                   superseded: bool) -> None:
    """Delete the files an intent manifest of generation ``gen`` lists, then the manifest. With
    ``superseded`` (only after a newer generation is committed) also the generation it superseded;
    never when abandoning a failed save, whose superseded generation is still the committed one."""
    try:
        man, _ = read_json(directory, intent, "save manifest", limit=1 << 20)
    except CheckpointError:
        return  # unreadable (killed while being written, or not ours): leave everything alone
    if not (isinstance(man, dict) and man.get("format") == INTENT_FORMAT
            and man.get("generation") == gen
            and isinstance(man.get("files"), list) and GEN_RE.match(gen)):
        return
    listed = [(name, gen) for name in man["files"]]
    old = man.get("supersedes") if superseded else None
    if isinstance(old, dict) and isinstance(old.get("generation"), str) \
            and GEN_RE.match(old["generation"]) and isinstance(old.get("files"), list):
        listed += [(name, old["generation"]) for name in old["files"]]
    for name, want in listed:
        if not isinstance(name, str) or name == intent:
            continue
        if not (RANK_RE.match(name) or TMP_RE.match(name)):
            continue
        g = generation_of(name)
        if g is not None and g != want:
            continue
        if skip_gen is not None and g == skip_gen:
            continue
        unlink(os.path.join(directory, name))
    unlink(os.path.join(directory, intent))


def save(optimizer, directory, *, group=None, chunk_bytes: int = DEFAULT_CHUNK,
         progress: Optional[bool] = None) -> str:
    """Save ``optimizer``'s state into ``directory`` atomically; returns the directory.

    Works for ``offload.Adam/AdamW``, any ``torch.optim`` optimizer with tensor state, and
    ``ZeroRedundancyOptimizer`` (each rank saves its shard). When torch.distributed is
    initialized, every rank of ``group`` must call it (one data file per rank, one index).
    ``progress``: tqdm bar (None: only for saves over 1 GiB on a terminal).
    """
    from .pending import deliver, dir_lock
    deliver(optimizer, group)
    s = Saver(optimizer, directory, group=group, chunk_bytes=chunk_bytes, progress=progress)
    with dir_lock(s.dir):
        try:
            s.write_rank_files()
        except BaseException:
            s.abandon()
            raise
        s.release()
        s.commit()
    return s.dir
