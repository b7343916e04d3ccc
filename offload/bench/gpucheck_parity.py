"""bench/gpucheck_parity.py: GPT-model parity of GPU offload against torch.optim.AdamW on the same
device (an L2-ratio check over whole training runs), part of check 03 of ``bench/gpu_check.py`` and
run by the tests through ``offload.bench.gpucheck.run_checks``.

For each case (fp32 / bf16 parameters x clipping on/off x gradient accumulation 1/2) a small GPT is
trained for a few steps twice from the same weights and batches:
  ours       offload.AdamW on the device parameters, state in host RAM (overlapped schedule);
  reference  torch.optim.AdamW on the device: on the parameters themselves for fp32, and for bf16
             on fp32 master copies (gradients cast up, clipping with
             torch.nn.utils.clip_grad_norm_, new weights rounded back into the bf16 model) - the
             standard master-weight recipe.
A case passes when ||ours - reference|| (L2 over all fp32 masters) is below ``tol`` times how far
the reference moved during the run (1e-4 for fp32 parameters, 2e-2 for bf16 where one flipped
rounding in the forward changes later gradients); bf16 weights are compared the same way.
``run_checks("fake")`` runs the same cases on CPU through the fake device (used by the tests).
"""
from __future__ import annotations

import contextlib
import copy
from typing import List

import torch

from .gpt import GPT, GPTConfig, param_groups, random_batch
from .gpucheck_common import l2_dist

__all__ = ["run_checks", "check_case", "print_checks"]

LR = 1e-3
CLIP = 0.05   # small enough that clipping is active in every step of the check


def _offload_device(kind: str):
    from offload.device import CudaDevice, FakeDevice
    return CudaDevice() if kind == "cuda" else FakeDevice(max_delay=0.002, seed=0)


def check_case(kind: str, dtype: torch.dtype, clip: bool, accum: int, steps: int, cfg: GPTConfig,
               overlap: bool = True) -> dict:
    import offload
    device = torch.device("cuda" if kind == "cuda" else "cpu")
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=dtype)
    ref_model = copy.deepcopy(model)
    init = [p.detach().float().clone() for p in model.parameters()]
    dev = _offload_device(kind)
    opts = dict(offload_device=dev, bucket_mb=0.05, overlap=overlap)
    if clip:
        opts["max_grad_norm"] = CLIP
    opt = offload.AdamW(param_groups(model, 0.1), lr=LR, **opts)
    if dtype == torch.float32:
        masters = list(ref_model.parameters())
    else:
        masters = [p.detach().float().clone().requires_grad_(True) for p in ref_model.parameters()]
    mp = {id(p): m for p, m in zip(ref_model.parameters(), masters)}
    ref_groups = [{**g, "params": [mp[id(p)] for p in g["params"]]}
                  for g in param_groups(ref_model, 0.1)]
    ref = torch.optim.AdamW(ref_groups, lr=LR)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for micro in range(accum):
            idx, tgt = random_batch(cfg, 2, device, gen)
            ctx = opt.no_sync() if micro < accum - 1 else contextlib.nullcontext()
            with ctx:
                model(idx, tgt).backward()
            ref_model(idx, tgt).backward()
        if dtype != torch.float32:
            for p, m in zip(ref_model.parameters(), masters):
                m.grad = p.grad.float()
        if clip:
            torch.nn.utils.clip_grad_norm_(masters, CLIP)
        ref.step()
        ref.zero_grad()
        ref_model.zero_grad()
        if dtype != torch.float32:
            with torch.no_grad():
                for p, m in zip(ref_model.parameters(), masters):
                    p.copy_(m)
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    dev.check()
    # compare
    state = opt.state_dict()["state"]
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    ours_master = []
    for p in model.parameters():
        st = state.get(index[id(p)], {})
        ours_master.append(st["master_param"].float().to(device) if "master_param" in st
                           else p.detach().float())
    # how far the reference moved, and how far ours is from it (L2 over all parameters): Adam's
    # update is ~lr per element whatever the gradient, so one flipped bf16 rounding in the forward
    # can change single elements by ~lr; the L2 ratio measures the whole update
    ref_masters = [m.detach() for m in masters]
    moved = l2_dist(ref_masters, init)
    d_master = l2_dist(ours_master, ref_masters)
    d_param = l2_dist([p.detach() for p in model.parameters()],
                      [p.detach() for p in ref_model.parameters()])
    finite = all(torch.isfinite(p).all().item() for p in model.parameters())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = finite and d_master <= tol * moved and d_param <= 2 * tol * moved
    stats = opt.last_step_stats(wait=True)
    opt.close()
    dev.close()
    return {"device": kind, "dtype": str(dtype).replace("torch.", ""), "clip": clip,
            "accum": accum,
            "steps": steps, "overlap": overlap, "moved": moved, "max_diff_master": d_master,
            "max_diff_param": d_param, "rel_diff": d_master / moved if moved else 0.0,
            "ok": bool(ok), "exposed_s": stats["exposed_s"] if stats else None}


def run_checks(kind: str, steps: int = 4, quick: bool = False) -> List[dict]:
    cfg = GPTConfig(vocab=64, seq=16, n_layer=2, n_head=2, d_model=32) if quick else \
        GPTConfig(vocab=512, seq=64, n_layer=2, n_head=4, d_model=128)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for clip in (False, True):
            for accum in (1, 2):
                out.append(check_case(kind, dtype, clip, accum, steps, cfg))
    out.append(check_case(kind, torch.bfloat16, True, 2, steps, cfg, overlap=False))
    return out


def print_checks(results: List[dict]) -> None:
    print(f"{'dtype':<9} {'clip':<5} {'accum':>5} {'overlap':<8} {'moved':>9} {'|d| master':>14} "
          f"{'|d| param':>13} {'rel':>8}  result")
    for r in results:
        print(f"{r['dtype']:<9} {str(r['clip']):<5} {r['accum']:>5} {str(r['overlap']):<8} "
              f"{r['moved']:>9.2e} {r['max_diff_master']:>14.2e} {r['max_diff_param']:>13.2e} "
              f"{r['rel_diff']:>8.1e}  {'ok' if r['ok'] else 'FAIL'}")
