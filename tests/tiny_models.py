"""tiny_models.py: what several test files share: the tiny random transformers model and token dataset
of the framework tests (transformers' Trainer, accelerate, PEFT; built locally from a fixed seed, no
downloads), and identities whose backward does something first: sleeps (device tests that need
backward slower than the copies, as on a GPU) or anything else (raises, in the failure tests)."""
import functools
import time

import torch


def slow_backward(x, seconds: float):
    """``x`` unchanged; its backward sleeps ``seconds`` first."""
    return on_backward(x, functools.partial(time.sleep, seconds))


def on_backward(x, action):
    """``x`` unchanged; its backward calls ``action()`` first."""
    return _OnBackward.apply(x, action)


class _OnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, action):
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.action()
        return g, None

VOCAB = 64


def tiny_llama(layers: int = 1):
    """LlamaForCausalLM with a 64-token vocabulary and 32-wide hidden state, seeded 0."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class Counting(torch.utils.data.Dataset):
    """n sequences of ctx consecutive tokens (mod VOCAB) from seeded random starts: learnable."""

    def __init__(self, n, ctx):
        g = torch.Generator().manual_seed(0)
        self.data = (torch.randint(0, VOCAB, (n, 1), generator=g) + torch.arange(ctx)) % VOCAB

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}
