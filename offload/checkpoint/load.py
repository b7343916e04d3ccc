"""checkpoint/load.py: ``offload.load`` - verify everything, then restore the optimizer.

Order: parse and validate index, rank index and safetensors header against the live optimizer
(validate.py), verify every checksum in a streaming pass, and only then modify the optimizer:
bytes go straight into its state tensors (RAM state), or views of a private mapping of the file
go to ``load_state_dict`` (NVMe/mmap store, device parameters). Nothing is ever unpickled. After a
refused load the optimizer is unchanged (only a file changed between the verify pass and the
read pass can leave it partially loaded, which is reported as such).
"""
from __future__ import annotations

import mmap
import os
import zlib

import torch

from ..base.dist import like, world
from . import adapter
from .format import DEFAULT_CHUNK, CheckpointError, build_value
from .validate import Plan, check_header, open_data, plan_load


def _view_bytes(t: torch.Tensor) -> memoryview:
    if t.is_complex():
        t = torch.view_as_real(t)
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _check_crc(path: str, f, t, buf: bytearray, base: int) -> None:
    f.seek(base + t.offsets[0])
    left, crc = t.offsets[1] - t.offsets[0], 0
    mv = memoryview(buf)
    while left:
        n = f.readinto(mv[:min(left, len(buf))])
        if not n:
            raise CheckpointError(f"{path} is truncated (tensor {t.name} ends early)")
        crc = zlib.crc32(mv[:n], crc)
        left -= n
    if crc != t.crc32:
        raise CheckpointError(f"checksum mismatch in {path} for tensor {t.name} (stored crc32 "
                              f"{t.crc32:08x}, file has {crc:08x}): the file is corrupted")


def _step(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def load(optimizer, directory, *, group=None, chunk_bytes: int = DEFAULT_CHUNK,
         verify: bool = True) -> None:
    """Load a checkpoint written by :func:`save` into ``optimizer`` (same class, layout and
    shapes).

    Restores state tensors, step counts and hyperparameters (like ``load_state_dict``). Nothing is
    changed unless every field, shape, dtype and (with ``verify``) every checksum is right.
    """
    from .pending import deliver
    deliver(optimizer, group)
    opt, group = adapter.resolve(optimizer, group)
    directory = os.path.abspath(os.fspath(directory))
    rank, world_size = world(group)
    plan = plan_load(opt, directory, rank, world_size)
    dpath = os.path.join(directory, plan.data_name)
    biggest = max([t.offsets[1] - t.offsets[0] for t in plan.tensors] + [1])
    buf = bytearray(max(1, min(int(chunk_bytes), biggest)))
    with open_data(directory, plan) as f:
        check_header(f, dpath, plan)
        base = plan.header_bytes
        if verify:
            for t in plan.tensors:
                _check_crc(dpath, f, t, buf, base)
        # ---- everything is validated: from here on the optimizer is modified
        if adapter.loads_itself(opt):
            _load_via_state_dict(opt, plan, f, base)
        else:
            _load_in_place(opt, plan, f, base, dpath, int(chunk_bytes), verify)
    adapter.sync_wrapper(optimizer, opt)
    adapter.set_pending_multiplier(opt, plan.multiplier)


def _load_in_place(opt, plan: Plan, f, base: int, dpath: str, chunk: int, verify: bool) -> None:
    ps = adapter.params(opt)
    saved_keys: dict = {}
    for t in plan.tensors:
        saved_keys.setdefault(t.param, set()).add(t.key)
    for i, (p, pp) in enumerate(zip(ps, plan.params)):
        if not pp.has_state:
            opt.state.pop(p, None)
            continue
        st = opt.state[p]
        for k in [k for k in st if k not in saved_keys.get(i, ()) and k != "step"]:
            del st[k]  # e.g. max_exp_avg_sq of a run with amsgrad, loading a run without
        if pp.step is not None:
            st["step"] = _step(pp.step)
        for k, spec in pp.extra.items():
            st[k] = build_value(spec, st.get(k))
    refs = {r.name: r for r in adapter.destinations(opt, plan.tensors, like)}
    for t in plan.tensors:
        ref = refs.get(t.name)
        if ref is None or ref.dtype != t.dtype or tuple(ref.shape) != t.shape:
            raise CheckpointError(f"optimizer could not provide a destination for {t.name}")
        f.seek(base + t.offsets[0])
        crc = 0
        for dst in ref.write_chunks(chunk):
            mv = _view_bytes(dst)
            got = f.readinto(mv) if len(mv) else 0
            if got != len(mv):
                raise CheckpointError(f"{dpath} is truncated (tensor {t.name}); optimizer "
                                      "state is now partial")
            crc = zlib.crc32(mv, crc)
        if verify and crc != t.crc32:
            raise CheckpointError(f"{dpath} changed while loading (tensor {t.name}); optimizer "
                                  "state is now partial")
    for g, specs in zip(opt.param_groups, plan.hyper):
        for k, spec in specs.items():
            g[k] = build_value(spec, g.get(k))
    adapter.readopt(opt)


def _load_via_state_dict(opt, plan: Plan, f, base: int) -> None:
    """NVMe/mmap store or device parameters: hand ``load_state_dict`` tensors that are views of a
    private mapping of the (verified) checkpoint file, so the store streams them bucket by bucket
    into its own file without the whole state ever being copied into RAM."""
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: nothing is written back
    state: dict = {}
    for i, pp in enumerate(plan.params):
        if pp.has_state:
            st = {k: build_value(spec) for k, spec in pp.extra.items()}
            if pp.step is not None:
                st["step"] = _step(pp.step)
            state[i] = st
    for t in plan.tensors:
        count = 1
        for d in t.shape:
            count *= d
        if count:
            real = {torch.complex64: torch.float32, torch.complex128: torch.float64,
                    torch.complex32: torch.float16}.get(t.dtype)
            if real is not None:
                v = torch.frombuffer(mm, dtype=real, count=2 * count, offset=base + t.offsets[0])
                v = torch.view_as_complex(v.view(list(t.shape) + [2]))
            else:
                v = torch.frombuffer(mm, dtype=t.dtype, count=count,
                                     offset=base + t.offsets[0]).view(t.shape)
        else:
            v = torch.empty(t.shape, dtype=t.dtype)
        state.setdefault(t.param, {})[t.key] = v
    groups = [dict({k: build_value(spec, g.get(k)) for k, spec in specs.items()},
                   params=list(range(sum(len(x["params"]) for x in opt.param_groups[:gi]),
                                     sum(len(x["params"]) for x in opt.param_groups[:gi + 1]))))
              for gi, (g, specs) in enumerate(zip(opt.param_groups, plan.hyper))]
    opt.load_state_dict({"state": state, "param_groups": groups})
    # the views die with ``state``; the mapping closes when the last one is gone
