"""examples/fsdp2.py: FSDP2 (``fully_shard``) with offload.AdamW stepping each rank's shard.

Every parameter is a DTensor; offload.AdamW updates each rank's local shard in place with the
native kernel (no gather), clips gradients with one all-reduce of a scalar, and checkpoints one
file per rank with ``offload.save``.

    python examples/fsdp2.py                  # spawns 2 CPU processes (gloo), tiny model, seconds
    torchrun --nproc-per-node 2 examples/fsdp2.py --steps 50
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import offload


def build_model(tiny: bool) -> torch.nn.Module:
    width, depth = (64, 2) if tiny else (1024, 8)
    blocks = []
    for _ in range(depth):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(torch.nn.Linear(16, width), *blocks, torch.nn.Linear(width, 16))


def train(rank: int, world: int, args) -> float:
    torch.manual_seed(0)  # same initial weights everywhere; fully_shard keeps each rank's slice
    model = build_model(args.tiny)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = offload.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    target = torch.nn.Linear(16, 16)  # the function to learn (same on every rank)
    loss = torch.tensor(0.0)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step * world + rank)  # each rank its own data
        x = torch.randn(args.batch, 16, generator=g)
        with torch.no_grad():
            y = target(x)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norm = opt.clip_grad_norm_(args.clip)  # global norm: one all-reduce of a scalar
        opt.step()
        sched.step()
        opt.zero_grad()
        if rank == 0 and (step % max(1, args.steps // 5) == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  grad-norm {float(norm):.3f}", flush=True)
    if args.save:
        offload.save(opt, args.save)  # one safetensors file per rank + index.json
        if rank == 0:
            print(f"saved optimizer state to {args.save}")
    return loss.item()


def _spawned(rank: int, world: int, rendezvous: str, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        train(rank, world, args)
        dist.barrier()  # nobody tears the group down while another rank still uses it
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True, help="tiny model (default)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--world-size", type=int, default=2, help="processes to spawn when not under torchrun")
    ap.add_argument("--save", default=None, help="directory for an offload checkpoint at the end")
    args = ap.parse_args(argv)
    if "RANK" in os.environ:  # launched by torchrun
        # gloo and CPU parameters: this version of offload steps CPU parameters (the GPU pipeline,
        # with the shards on the GPU and their state in host memory, is a separate mode)
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:  # file rendezvous: no TCP port to pick
        mp.spawn(_spawned, args=(args.world_size, os.path.join(tmp, "rendezvous"), args),
                 nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
