"""bench/gpt.py: a small GPT-style language model (no downloads) for the train benchmark and
gpu_check.

Token + position embeddings, pre-norm transformer blocks (causal self-attention, GELU MLP), final
LayerNorm, output head tied to the token embedding (``F.linear(x, wte.weight)``), cross-entropy
loss. ``param_groups`` splits parameters into decayed matrices and non-decayed norms/biases, the
usual GPT recipe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "param_groups", "random_batch", "PRESETS"]


@dataclass
class GPTConfig:
    vocab: int = 512
    seq: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64


PRESETS = {
    "tiny": GPTConfig(vocab=64, seq=16, n_layer=2, n_head=2, d_model=32),
    "small": GPTConfig(vocab=4096, seq=128, n_layer=4, n_head=4, d_model=256),
    "125m": GPTConfig(vocab=50304, seq=512, n_layer=12, n_head=12, d_model=768),
    "350m": GPTConfig(vocab=50304, seq=512, n_layer=24, n_head=16, d_model=1024),
    # 4.23B: fp32 weights, gradients and Adam moments (68 GB) do not fit next to activations on an
    # 80 GB GPU
    "4b": GPTConfig(vocab=50304, seq=512, n_layer=20, n_head=32, d_model=4096),
}


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.ln1 = nn.LayerNorm(c.d_model)
        # a key bias gets only rounding noise
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.d_model)
        self.wpe = nn.Embedding(c.seq, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = (0.02 / math.sqrt(2 * c.n_layer)
                       if name.endswith(("proj.weight", "out.weight")) else 0.02)
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # head tied to the token embedding
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def param_groups(model: nn.Module, weight_decay: float = 0.1, lr_scale_no_decay: float = 1.0,
                 lr=None):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    g2 = {"params": no_decay, "weight_decay": 0.0}
    if lr is not None:
        g2["lr"] = lr * lr_scale_no_decay
    return [{"params": decay, "weight_decay": weight_decay}, g2]


def random_batch(c: GPTConfig, batch: int, device, generator: torch.Generator):
    idx = torch.randint(0, c.vocab, (batch, c.seq + 1), generator=generator).to(device)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
