"""examples/train_loop.py: a plain PyTorch training loop with offload.AdamW.

Shows the pieces a real loop needs: parameter groups (no weight decay on biases and norms), an LR
schedule (linear warmup then cosine, any ``torch.optim.lr_scheduler`` works), gradient clipping
with ``optimizer.clip_grad_norm_`` (the coefficient is folded into the next step's kernel pass
instead of rescaling the gradients), and resumable checkpoints with ``offload.save/load``.

    python examples/train_loop.py                    # tiny model on CPU, a few seconds
    python examples/train_loop.py --steps 200 --ckpt /tmp/run1     # saves every --save-every steps
    python examples/train_loop.py --steps 300 --ckpt /tmp/run1 --resume

offload steps CPU parameters in this version (GPU offload, with parameters on the GPU and the
state in host memory, is the pipeline mode still being built); ``--device cuda`` will say so.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

import offload


class TinyLM(torch.nn.Module):
    """A small causal transformer language model."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, ctx: int):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(ctx, width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


def batches(vocab: int, ctx: int, batch: int, seed: int):
    """Synthetic, learnable data: each sequence counts upward modulo ``vocab`` from a random start."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        seq = (start + torch.arange(ctx + 1)) % vocab
        yield seq[:, :-1], seq[:, 1:]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name or name.endswith("bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return f


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True, help="tiny model (default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (model + optimizer + schedule)")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)

    vocab, width, layers, heads, ctx, batch = (32, 32, 2, 2, 16, 16) if args.tiny else (8192, 768, 12, 12, 512, 8)
    torch.manual_seed(0)
    model = TinyLM(vocab, width, layers, heads, ctx).to(args.device)
    opt = offload.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(max(1, args.steps // 10), args.steps))
    start = 0
    if args.resume:
        from safetensors.torch import load_model
        load_model(model, os.path.join(args.ckpt, "model.safetensors"))
        offload.load(opt, os.path.join(args.ckpt, "optim"))
        with open(os.path.join(args.ckpt, "loop.json")) as f:
            loop = json.load(f)
        sched.load_state_dict(loop["scheduler"])
        start = loop["step"]
        print(f"resumed at step {start}")
    data = batches(vocab, ctx, batch, seed=start)
    loss = torch.tensor(float("nan"))
    for step in range(start, args.steps):
        x, y = (t.to(args.device) for t in next(data))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norm = opt.clip_grad_norm_(args.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  grad-norm {float(norm):.3f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}", flush=True)
        if args.ckpt and ((step + 1) % args.save_every == 0 or step == args.steps - 1):
            save(args.ckpt, model, opt, sched, step + 1)
    return loss.item()


def save(directory: str, model, opt, sched, step: int) -> None:
    """Model weights (safetensors), optimizer (offload, streamed + atomic), loop state (JSON)."""
    from safetensors.torch import save_model
    os.makedirs(directory, exist_ok=True)
    offload.save(opt, os.path.join(directory, "optim"))
    tmp = os.path.join(directory, "model.safetensors.tmp")
    save_model(model, tmp)
    os.replace(tmp, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "loop.json.tmp"), "w") as f:
        json.dump({"step": step, "scheduler": sched.state_dict()}, f)
    os.replace(os.path.join(directory, "loop.json.tmp"), os.path.join(directory, "loop.json"))


if __name__ == "__main__":
    main()
