"""tools/arm/train_check.py: offload.AdamW on every ISA the CPU offers, against torch.optim.AdamW:
a small model trained a few steps in fp32 (forward, backward, step), and the same model in bf16
stepped with given bf16 gradients (its fp32 master against torch's AdamW on an fp32 copy, as
tests/test_optim.py does; the bf16 weights the rounded master). Every ISA's results equal the
others' bit for bit; each is within the tolerance of tests/test_optim.py of torch's (not its bits:
the kernel multiplies by 1 / sqrt(1 - beta2^t) where torch divides, csrc/kernels_impl.h). Runs
wherever torch and offload import; tools/arm/check.py --full runs it in aarch64 CPython under qemu.
Prints one line per dtype; exit 1 on any difference."""

import sys

import torch
import torch.nn.functional as F

import offload
from offload import kernels

STEPS = 4


def model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 10)
    ).to(dtype)


def train_fp32(make_opt):
    """The weights after STEPS steps of forward, backward and step."""
    m = model(torch.float32)
    opt = make_opt(m.parameters())
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 48, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    for _ in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


def step_bf16(make_opt, master):
    """bf16 weights (or, with `master`, fp32 ones) after STEPS steps with given bf16 gradients;
    with an offload optimizer, its fp32 masters after them."""
    m = model(torch.bfloat16).float() if master else model(torch.bfloat16)
    opt = make_opt(m.parameters())
    gen = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16).to(p.dtype)
        opt.step()
    weights = [p.detach().clone() for p in m.parameters()]
    return (
        weights
        if master
        else weights + [opt.state[p]["master_param"].clone() for p in m.parameters()]
    )


def compare(name, theirs, ours, isas, masters_of):
    """Failures: ISAs whose results differ from the first's; masters not within the tolerance of
    torch's."""
    failures = [
        f"{name}: {isa} differs from {isas[0]}"
        for isa in isas
        if not all(torch.equal(a, b) for a, b in zip(ours[isa], ours[isas[0]]))
    ]
    try:
        for a, b in zip(masters_of(ours[isas[-1]]), theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    except AssertionError as e:
        failures.append(f"{name}: against torch.optim.AdamW: {e}")
    print(
        f"{name}, {STEPS} steps, ISAs {', '.join(isas)}: "
        f"{'FAILED' if failures else 'equal to each other, and to torch within tolerance'}"
    )
    return failures


def main():
    torch.set_num_threads(1)
    kw = dict(lr=1e-2, weight_decay=0.05)
    isas = kernels.available_isas()
    ours32, ours16 = {}, {}
    for isa in isas:
        kernels.set_isa(isa)
        ours32[isa] = train_fp32(lambda ps: offload.AdamW(ps, **kw))
        ours16[isa] = step_bf16(lambda ps: offload.AdamW(ps, **kw), master=False)
    kernels.set_isa("auto")
    failures = compare(
        "fp32, forward + backward + step",
        train_fp32(lambda ps: torch.optim.AdamW(ps, **kw)),
        ours32,
        isas,
        lambda r: r,
    )
    half = len(ours16[isas[0]]) // 2  # (bf16 weights, then their fp32 masters)
    failures += compare(
        "bf16 weights, fp32 master",
        step_bf16(lambda ps: torch.optim.AdamW(ps, **kw), master=True),
        ours16,
        isas,
        lambda r: r[half:],
    )
    if not all(
        torch.equal(w, m.to(torch.bfloat16))
        for w, m in zip(ours16[isas[-1]][:half], ours16[isas[-1]][half:])
    ):
        failures.append("bf16 weights are not their rounded fp32 masters")
    print(
        f"torch {torch.__version__}, offload {offload.__version__}, chosen ISA {kernels.get_isa()}"
    )
    for f in failures:
        print(f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
