"""params/fingerprint.py: exact integer fingerprints of device parameters, to notice writes that
move no version counter (``p.data.mul_(...)``, ``p.data.clamp_(...)``, ``p.data.copy_(...)``).

A write through ``p.data`` changes neither the parameter's version counter nor its pointer, so the
device schedule (schedule/device_step.py) could not see it and the next step overwrote it with
round(master) (a reverted write: torch's AdamW keeps it). The schedule takes these fingerprints
once the new weights are on the device and compares them before the next update; a parameter whose
fingerprint differs has its fp32 master re-read, as for a write the version counter shows.

Computed by torch on the tensor's own device (one pass over the parameter's bytes, in chunks, so
the temporaries stay small): per tensor a position-weighted sum of its elements' bits as integers,
each times an odd pseudo-random int32 weight, the products exact in int64 (|product| < 2^62) and
summed modulo 2^64. Changes d_i of the elements' bits change it by sum(w_i * d_i) mod 2^64, a
linear form in the changes with pseudo-random weights: a single changed element always changes it
(an odd weight is invertible modulo 2^64), and several cancel only if that form happens to vanish.
(Products wrapped modulo 2^32 would not do: a uniform change such as `p.data.mul_(0.5)`, every
element's bits -2^23, would change the sum only by the number of wrap carries minus a constant, a
random walk that cancels for 1-3 % of tensors of 1024-16384 elements: the write would be silently
reverted.) For CPU tensors (the CPU devices of the tests, `bench train` without a GPU) the same
kind of sum over 32-bit words is computed natively (``native_adam.fingerprint``, at memory speed);
on a GPU by torch, at its memory bandwidth. Each device's fingerprints are only ever compared with
its own.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from ..native import adam as native_adam

__all__ = ["fingerprints", "chunk_weights", "CHUNK"]

CHUNK = 1 << 21   # elements per pass: 16 MiB of int64 temporaries at most (the weights: as many)
_weights: Dict[torch.device, torch.Tensor] = {}


def chunk_weights(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        # odd, pseudo-random int32 per position in a chunk (Knuth's multiplicative constant,
        # wrapping)
        idx = torch.arange(CHUNK, dtype=torch.int64, device=device)
        # int64 holding odd int32 values
        w = (((idx * 2654435761 + 0x9E3779B9) % (1 << 32) - (1 << 31)) | 1)
        _weights[device] = w
    return w


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values in plain contiguous memory (what the native sum may read)."""
    t = t.detach()
    if t.is_neg() or t.is_conj():
        t = t.resolve_neg().resolve_conj()
    return t if t.is_contiguous() else t.contiguous()


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements' bits as a flat integer tensor (wider elements as several int32
    words)."""
    x = t.detach().reshape(-1)
    es = x.element_size()
    return x.view(torch.int32) if es >= 4 else x.view(torch.int16 if es == 2 else torch.int8)


def fingerprints(tensors: Sequence[torch.Tensor], native: Optional[bool] = None) -> torch.Tensor:
    """(len(tensors),) int64 on the tensors' device (all on one device; empty: on the CPU).
    ``native``: the native sum (CPU tensors only; the default there) or torch's ops (elsewhere;
    tests force it on CPU tensors)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    device = tensors[0].device
    if native is None:
        native = device.type == "cpu"
    if native:   # the devices of the tests and of `bench train` here: natively, at memory speed
        return torch.tensor([native_adam.fingerprint(_plain(t)) for t in tensors],
                            dtype=torch.int64)
    w = chunk_weights(device)
    out = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    # tensors of one chunk or less, by integer view: summed in batches
    small: Dict[torch.dtype, list] = {}
    for j, t in enumerate(tensors):
        ints = _as_ints(t)
        if ints.numel() <= CHUNK:
            small.setdefault(ints.dtype, []).append((j, ints))
            continue
        h = torch.zeros((), dtype=torch.int64, device=device)
        for k, start in enumerate(range(0, ints.numel(), CHUNK)):
            c = ints[start:start + CHUNK]
            # int64 products (promotion)
            h += torch.mul(c, w[:c.numel()]).sum(dtype=torch.int64) * (2 * k + 1)
        out[j] = h
    # the same sums, a few kernels per batch instead of a few per tensor
    for group in small.values():
        batch, n = [], 0
        for item in group + [None]:
            if item is not None and n + item[1].numel() <= CHUNK:
                batch.append(item)
                n += item[1].numel()
                continue
            if batch:
                _batched(batch, w, out)
            batch, n = ([item], item[1].numel()) if item is not None else ([], 0)
    return out


def _batched(batch: list, w: torch.Tensor, out: torch.Tensor) -> None:
    """out[j] = sum(ints * w[:len]) for each (j, ints) of ``batch`` (together at most one chunk),
    in a fixed number of kernels: the products' running sum (int64, wrapping like the sums
    themselves) read at each tensor's two ends. No atomics, no host sync, and the one
    host-to-device copy (the ends and the output positions) comes from pinned memory on CUDA."""
    device = out.device
    sizes = [ints.numel() for _, ints in batch]
    flat = torch.cat([ints for _, ints in batch]).to(torch.int64)   # (one integer dtype per batch)
    prods = torch.mul(flat, torch.cat([w[:n] for n in sizes]))
    run = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), prods.cumsum(0)])
    ends, at = [], 0
    for n in sizes:
        at += n
        ends.append(at)
    host = torch.tensor([e - n for e, n in zip(ends, sizes)] + ends + [j for j, _ in batch],
                        dtype=torch.int64)
    if device.type == "cuda":
        idx = host.pin_memory().to(device, non_blocking=True)
    else:
        idx = host.to(device)
    k = len(batch)
    out[idx[2 * k:]] = run.index_select(0, idx[k:2 * k]) - run.index_select(0, idx[:k])
