"""checkpoint/validate.py: read and check a checkpoint against a live optimizer, changing nothing.

Produces a :class:`Plan` only when every field of ``index.json``, the rank index and the
safetensors header has the right type and range, every file name is our own generated name,
every tensor lies inside the data file, every state tensor fits its parameter (shape, dtype),
every hyperparameter has the kind of value the optimizer holds, and the optimizer class matches.
Anything else is a :class:`CheckpointError`; the optimizer is not touched here.
"""
from __future__ import annotations

import math
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..base.dist import is_dtensor, local
from ..moments.format import CODE_VERSIONS, moment_format, parse_saved_key
from . import adapter
from .format import (DTYPES, FORMAT, GEN_RE, INDEX, MAX_JSON, TAGS, VERSION, CheckpointError,
                     check_compatible,
                     check_plain_name, decode_json, decode_value, element_size, file_layout,
                     is_int, is_number, open_regular, rank_name, read_json)

_MAX_DIMS = 64
_KEY_RE = re.compile(r"[A-Za-z0-9_.\-]{1,128}\Z")
_RESERVED = ("params", "param_names")


@dataclass
class TensorPlan:
    name: str
    param: int
    key: str
    dtype: torch.dtype
    shape: tuple
    offsets: tuple
    crc32: int


@dataclass
class ParamPlan:
    has_state: bool
    step: Optional[float]
    extra: dict  # key -> value spec


@dataclass
class Plan:
    data_name: str
    data_bytes: int
    header_bytes: int
    tensors: List[TensorPlan] = field(default_factory=list)
    params: List[ParamPlan] = field(default_factory=list)
    hyper: List[dict] = field(default_factory=list)  # per group: key -> value spec
    multiplier: float = 1.0


def _need(cond, msg: str) -> None:
    if not cond:
        raise CheckpointError(msg)


def _field(d: dict, key: str, check, what: str):
    _need(isinstance(d, dict) and key in d, f"{what}: field '{key}' is missing: the "
                                            "file is corrupted")
    v = d[key]
    _need(check(v), f"{what}: field '{key}' has an invalid value {str(v)[:80]!r}: the "
                    "file is corrupted")
    return v


def _shape(v) -> bool:
    return (isinstance(v, list) and len(v) <= _MAX_DIMS
            and all(is_int(d) and 0 <= d < (1 << 62) for d in v))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_index(directory: str, rank: int, world_size: int) -> dict:
    """index.json -> this rank's entry, validated (names are exactly our generated names)."""
    index, _ = read_json(directory, INDEX, "checkpoint index")
    what = f"{os.path.join(directory, INDEX)}"
    _need(isinstance(index, dict) and index.get("format") == FORMAT,
          f"{what} is not an offload checkpoint index")
    _need(index.get("version") == VERSION and is_int(index.get("version")),
          f"checkpoint format version {index.get('version')!r} is not supported "
          f"(this is {VERSION})")
    ws = _field(index, "world_size", lambda v: is_int(v) and 1 <= v <= 1 << 20, what)
    gen = _field(index, "generation", lambda v: isinstance(v, str) and GEN_RE.match(v), what)
    _need(ws == world_size, f"checkpoint in {directory} was saved by {ws} rank(s); it is being "
                            f"loaded by {world_size}: each rank loads its own shard, so the world "
                            "size must match")
    ranks = _field(index, "ranks", lambda v: isinstance(v, list) and len(v) == ws, what)
    entry = ranks[rank]
    ew = f"{what} rank {rank}"
    for key, ext in (("index", "json"), ("data", "safetensors")):
        name = check_plain_name(_field(entry, key, lambda v: True, ew), f"{ew} '{key}'")
        _need(name == rank_name(rank, ws, gen, ext),
              f"{ew} '{key}' names {name!r}, not the file name offload gives generation {gen} "
              f"({rank_name(rank, ws, gen, ext)}): refusing to follow it (the index is "
              "corrupted or crafted)")
    _field(entry, "index_crc32", lambda v: is_int(v) and 0 <= v < 1 << 32, ew)
    _field(entry, "data_bytes", lambda v: is_int(v) and 0 <= v < 1 << 62, ew)
    return dict(entry, generation=gen)


def read_rank_index(directory: str, entry: dict, rank: int, world_size: int) -> dict:
    ridx, raw = read_json(directory, entry["index"], "rank index")
    rpath = os.path.join(directory, entry["index"])
    _need(zlib.crc32(raw) == entry["index_crc32"], f"checksum mismatch for {rpath}: the rank "
                                                   "index is corrupted")
    _need(isinstance(ridx, dict) and ridx.get("format") == FORMAT + "-rank"
          and ridx.get("version") == VERSION,
          f"{rpath} is not an offload rank index of format version {VERSION}")
    for key, want in (("rank", rank), ("world_size", world_size),
                      ("generation", entry["generation"]),
                      ("data_file", entry["data"]), ("data_bytes", entry["data_bytes"])):
        _need(ridx.get(key) == want and type(ridx.get(key)) is type(want),
              f"{rpath}: '{key}' is {str(ridx.get(key))[:60]!r}, index.json says {want!r}: the "
              "checkpoint is corrupted")
    return ridx


def _check_kind(opt, ridx: dict, rpath: str) -> None:
    saved = ridx.get("optimizer_kind", ridx.get("optimizer"))
    _need(isinstance(saved, str), f"{rpath}: the optimizer class is missing")
    mine = adapter.kind(opt)
    _need(saved == mine, f"the checkpoint was saved from a {saved} optimizer "
                         f"({ridx.get('optimizer')}), it is being loaded into "
                         f"{type(opt).__module__}.{type(opt).__name__} ({mine}): their state and "
                         "hyperparameters mean different things; build the same optimizer "
                         "class to resume")


def _check_groups(opt, ridx: dict, rpath: str, directory: str) -> list:
    saved = _field(ridx, "param_groups", lambda v: isinstance(v, list), rpath)
    groups = opt.param_groups
    _need(len(groups) == len(saved),
          f"checkpoint {directory} has {len(saved)} param group(s); the optimizer "
          f"has {len(groups)}")
    hyper, start = [], 0
    for gi, (g, sg) in enumerate(zip(groups, saved)):
        w = f"{rpath}: param group {gi}"
        n = len(g["params"])
        ps = _field(sg, "params", lambda v: isinstance(v, list) and all(is_int(i) for i in v), w)
        _need(len(ps) == n, f"param group {gi}: checkpoint has {len(ps)} parameters, the "
                            f"optimizer has {n}")
        _need(ps == list(range(start, start + n)), f"{w}: parameter indices {str(ps)[:60]} are "
                                                   f"not {start}..{start + n - 1}: the "
                                                   "file is corrupted")
        if "param_names" in sg:
            _need(isinstance(sg["param_names"], list) and len(sg["param_names"]) == n
                  and all(isinstance(s, str) for s in sg["param_names"]),
                  f"{w}: invalid param_names")
        hy = _field(sg, "hyper", lambda v: isinstance(v, dict), w)
        specs = {}
        for k, v in hy.items():
            _need(isinstance(k, str) and k not in _RESERVED and len(k) <= 128,
                  f"{w}: hyperparameter key {k!r} is not allowed (it would replace the "
                  "parameter list)")
            spec = decode_value(v, f"{w} '{k}'")
            if k in g:
                check_compatible(spec, g[k], f"param group {gi} '{k}'")
            specs[k] = spec
        hyper.append(specs)
        start += n
    return hyper


def _check_params(opt, ridx: dict, rpath: str) -> List[ParamPlan]:
    ps = adapter.params(opt)
    recs = _field(ridx, "params", lambda v: isinstance(v, list), rpath)
    _need(len(recs) == len(ps), f"{rpath}: {len(recs)} parameter records for {len(ps)} "
                                "parameters: corrupted")
    out = []
    for i, (p, rec) in enumerate(zip(ps, recs)):
        w = f"{rpath}: parameter {i}"
        lp = local(p)
        shape = _field(rec, "shape", _shape, w)
        gshape = rec.get("global_shape") if isinstance(rec, dict) else None
        _need(gshape is None or _shape(gshape), f"{w}: invalid global_shape")
        if shape != list(lp.shape) or (is_dtensor(p) and gshape not in (None, list(p.shape))):
            saved_shape = gshape or shape
            saved_local = f" (local {tuple(shape)})" if gshape else ""
            model_local = f" (local {tuple(lp.shape)})" if is_dtensor(p) else ""
            raise CheckpointError(f"parameter {i}: checkpoint was saved for shape "
                                  f"{tuple(saved_shape)}{saved_local}, "
                                  "but the model's parameter has shape "
                                  f"{tuple(p.shape)}{model_local}: "
                                  "refusing to load into a different model")
        dt = _field(rec, "dtype", lambda v: isinstance(v, str), w)
        _need(dt == str(lp.dtype).replace("torch.", ""),
              f"parameter {i}: checkpoint was saved for a {dt} parameter, the model's is "
              f"{lp.dtype}: convert the model back to the dtype it was trained with before "
              "loading its optimizer state")
        has = _field(rec, "has_state", lambda v: isinstance(v, bool), w)
        step = rec.get("step")
        _need(step is None or (is_number(step) and math.isfinite(step) and 0 <= step < 2 ** 53),
              f"{w}: invalid step count {str(step)[:40]!r}: the file is corrupted")
        extra = _field(rec, "extra", lambda v: isinstance(v, dict), w)
        specs = {}
        cur = opt.state.get(p) or {}
        for k, v in extra.items():
            _need(isinstance(k, str) and _KEY_RE.match(k) and k != "step",
                  f"{w}: invalid state key {k!r}")
            specs[k] = decode_value(v, f"{w} state '{k}'")
            if k in cur and not isinstance(cur[k], torch.Tensor):
                check_compatible(specs[k], cur[k], f"state of parameter {i} '{k}'")
        _need(has or (step is None and not extra), f"{w}: has no state but lists some: corrupted")
        out.append(ParamPlan(has, None if step is None else float(step), specs))
    return out


def _check_tensors(opt, ridx: dict, rpath: str, pplans: List[ParamPlan]) -> List[TensorPlan]:
    ps = adapter.params(opt)
    strict = adapter.kind(opt) in adapter.ADAM_KINDS
    recs = _field(ridx, "tensors", lambda v: isinstance(v, list), rpath)
    header_bytes = _field(ridx, "header_bytes", lambda v: is_int(v) and 8 <= v <= MAX_JSON + 8,
                          rpath)
    data_bytes = ridx["data_bytes"]
    out, seen, off = [], set(), 0
    for j, rec in enumerate(recs):
        w = f"{rpath}: tensor {j}"
        pi = _field(rec, "param", lambda v: is_int(v) and 0 <= v < len(ps), w)
        key = _field(rec, "key", lambda v: isinstance(v, str) and _KEY_RE.match(v) and v != "step",
                     w)
        name = _field(rec, "name", lambda v: v == f"state.{pi}.{key}", w)
        _need(name not in seen and key not in pplans[pi].extra,
              f"{w}: {name} is listed twice: corrupted")
        seen.add(name)
        tag = _field(rec, "dtype", lambda v: isinstance(v, str) and v in DTYPES, w)
        shape = _field(rec, "shape", _shape, w)
        offs = _field(rec, "offsets",
                      lambda v: isinstance(v, list) and len(v) == 2 and all(is_int(x) for x in v),
                      w)
        crc = _field(rec, "crc32", lambda v: is_int(v) and 0 <= v < 1 << 32, w)
        _need(pplans[pi].has_state, f"{w}: state for parameter {pi}, which has none: corrupted")
        p = local(ps[pi])
        dtype = DTYPES[tag]
        packed = parse_saved_key(key) if strict else None
        if packed is not None:  # compressed moments (offload/moments/format.py)
            k0, sfmt = packed
            _need(adapter.keepalive(opt) is not None,
                  f"{name}: the checkpoint holds moments={sfmt!r} (compressed) state, this "
                  f"optimizer has moments={getattr(opt, 'moments', 'fp32')!r} with state in plain "
                  f"tensors: build it with moments={sfmt!r} (or any moments= with "
                  "storage='nvme'/'mmap', which converts) to load it")
            codes = ridx.get("moment_codes", {})   # absent: code version 1
            saved_code = codes.get(sfmt, 1) if isinstance(codes, dict) else None
            _need(saved_code == CODE_VERSIONS[sfmt],
                  f"{name}: the checkpoint's {sfmt} moments were written with byte code version "
                  f"{saved_code!r}, this offload decodes version {CODE_VERSIONS[sfmt]}: loading "
                  "them would give wrong moments. Load the checkpoint with the offload version "
                  "that wrote it and save opt.state_dict() (fp32 moments, which any version "
                  "loads), or resume with fresh moments")
            want_dt, want_n = moment_format(sfmt).spec(p.numel())[k0]
            _need(dtype == want_dt and _numel(shape) == want_n,
                  f"{name}: a {sfmt} moment tensor of dtype {dtype} and shape {tuple(shape)}, "
                  f"expected {want_dt} with {want_n} entries for parameter {pi} "
                  f"({tuple(p.shape)}): the checkpoint is corrupted")
        elif strict:
            _need(tuple(shape) == tuple(p.shape),
                  f"{name}: the checkpoint's state tensor has shape {tuple(shape)}, parameter "
                  f"{pi} has shape {tuple(p.shape)}: the checkpoint is corrupted or "
                  "for another model")
            _need(dtype in (p.dtype, torch.float32) or (p.dtype.is_complex and dtype.is_complex),
                  f"{name}: state of dtype {dtype} for a {p.dtype} parameter: the "
                  "checkpoint is corrupted")
        else:
            _need(_numel(shape) <= max(p.numel(), 1), f"{name}: state tensor of shape "
                                                      f"{tuple(shape)} is larger than parameter "
                                                      f"{pi} ({tuple(p.shape)}): corrupted")
        nbytes = _numel(shape) * element_size(tag)
        _need(offs == [off, off + nbytes], f"{name}: data offsets {offs} do not match its size "
                                           f"{nbytes} at {off}: the rank index is corrupted")
        off += nbytes
        out.append(TensorPlan(name, pi, key, dtype, tuple(shape), (offs[0], offs[1]), crc))
    _need(header_bytes + off == data_bytes, f"{rpath}: header ({header_bytes}) + tensors ({off}) "
                                            f"!= data size ({data_bytes}): the rank "
                                            "index is corrupted")
    return out


def check_header(f, dpath: str, plan: Plan) -> None:
    """Parse the safetensors header (JSON only) and cross-check it with the validated rank
    index."""
    head = f.read(8)
    _need(len(head) == 8, f"{dpath} is truncated")
    (n,) = struct.unpack("<Q", head)
    _need(n == plan.header_bytes - 8, f"{dpath}: header size {n} does not match the index: the "
                                      "file is corrupted")
    header = decode_json(f.read(n), f"{dpath}: the safetensors header")
    _need(isinstance(header, dict), f"{dpath}: the safetensors header is corrupted")
    for t in plan.tensors:
        st_dtype, st_shape = file_layout(TAGS[t.dtype], list(t.shape))
        _need(header.get(t.name) == {"dtype": st_dtype, "shape": st_shape,
                                     "data_offsets": list(t.offsets)},
              f"{dpath}: header entry for {t.name} disagrees with the index: corrupted")


def plan_load(opt, directory: str, rank: int, world_size: int) -> Plan:
    entry = read_index(directory, rank, world_size)
    ridx = read_rank_index(directory, entry, rank, world_size)
    rpath = os.path.join(directory, entry["index"])
    try:
        _check_kind(opt, ridx, rpath)
        hyper = _check_groups(opt, ridx, rpath, directory)
        pplans = _check_params(opt, ridx, rpath)
        tensors = _check_tensors(opt, ridx, rpath, pplans)
        mult = ridx.get("pending_grad_multiplier", 1.0)
        _need(is_number(mult) and math.isfinite(mult), f"{rpath}: invalid pending_grad_multiplier")
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError,
            OverflowError) as e:
        # every field is checked above; this is a last line of defence, never reached by a known
        # input
        raise CheckpointError(f"{rpath}: malformed rank index ({type(e).__name__}: {e})") from None
    return Plan(entry["data"], entry["data_bytes"], ridx["header_bytes"], tensors, pplans, hyper,
                float(mult))


def open_data(directory: str, plan: Plan):
    fd = open_regular(directory, plan.data_name, "data file")
    f = os.fdopen(fd, "rb")
    size = os.fstat(fd).st_size
    if size != plan.data_bytes:
        f.close()
        raise CheckpointError(f"{os.path.join(directory, plan.data_name)} has {size} bytes, the "
                              f"index says {plan.data_bytes}: the file is truncated or corrupted")
    return f
