"""bench/ranks.py: several torch.distributed ranks against one process - the tiny model, its batches
(each rank takes its share of the full batch), the single-process torch.optim.AdamW reference on the
full batch, and the comparison to rounding. Shared by the 2-rank gloo tests (tests/test_distributed.py,
tests/test_device_distributed.py) and by the GPU check.
"""
import torch

WORLD = 2
STEPS = 4


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 24),
                               torch.nn.GELU(), torch.nn.Linear(24, 5))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * 4, 12, generator=g), torch.randn(WORLD * 4, 5, generator=g)


def reference(steps, clip=None):
    """Single-process torch.optim.AdamW on the full batch: what every rank must reproduce."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for s in range(steps):
        x, y = batch(s)
        torch.nn.functional.mse_loss(net(x), y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()], norms


def local_batch(step, rank):
    x, y = batch(step)
    return x[rank::WORLD], y[rank::WORLD]


def close(a, b, what):
    torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m: f"{what}: {m}")
