"""test_kernel_bitwise.py: the native Adam kernel, every forced ISA path x grad dtype x output dtype x
variant, against the plain scalar reference (bitwise: all paths do the same IEEE operations in the same
order with FMA contraction disabled), across thread counts, on non-finite and special inputs, against
torch's cast and against float64 math; the gradient sum of squares."""
import itertools

import numpy as np
import pytest
import torch

from offload import kernels
from kernel_util import DTYPES, VARIANTS, assert_bitwise, clone, make_state, nonfinite_inputs, run

SIZES = [0, 1, 15, 16, 17, 63, 4097]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gd,od", list(itertools.product(["f32", "bf16", "f16"], [None, "bf16", "f16"])))
def test_isa_matches_reference_bitwise(isa, n, gd, od):
    for vi, variant in enumerate(VARIANTS):
        state = make_state(n, DTYPES[gd], DTYPES.get(od), seed=n * 31 + vi)
        ref = clone(state)
        mult = 0.5 if vi % 2 else 1.0
        run(state, variant, mult=mult)
        run(ref, variant, mult=mult, reference=True)
        assert_bitwise(state, ref)


@pytest.mark.parametrize("gd,od,vi", [("f32", None, 1), ("bf16", "bf16", 6), ("f16", "f16", 11)])
def test_large_odd_size_matches_reference(isa, gd, od, vi):
    n = (1 << 20) + 3
    state = make_state(n, DTYPES[gd], DTYPES.get(od), seed=7)
    ref = clone(state)
    run(state, VARIANTS[vi], step=1, mult=0.25)
    run(ref, VARIANTS[vi], step=1, mult=0.25, reference=True)
    assert_bitwise(state, ref)


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("gd,od", [("bf16", "bf16"), ("f32", None), ("f32", "f32"), ("f16", "bf16"), ("bf16", None)])
def test_bitwise_identical_across_thread_counts(threads, gd, od):
    # several 1024-element chunks of the dtype passes per thread, thread ranges that start inside a
    # chunk (they are cut on 16-element multiples), an odd tail; against the scalar reference too
    n = 300_007
    base = make_state(n, DTYPES[gd], DTYPES.get(od), seed=1)
    one = clone(base)
    run(one, VARIANTS[3], threads=1, reference=True)
    many = clone(base)
    kernels.set_num_threads(max(threads, kernels.get_num_threads()))
    run(many, VARIANTS[3], threads=threads)
    assert_bitwise(many, one)


def _specials():
    # ties, subnormals, overflow edge, signed zeros, large values
    vals = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 1e-8, -1e-8, 6e-8, 3e-8, 5.9604645e-08,
            2.9802322e-08, 1.0000001, 1.00390625, 1.005859375, 3.0e38, -3.0e38, 1e-40, -1e-45, 6.1e-5,
            2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25]
    gen = torch.Generator().manual_seed(3)
    rnd = torch.cat([torch.randn(4096, generator=gen) * s for s in (1e-6, 1e-3, 1.0, 1e3, 1e5)])
    bits = torch.randint(-2**31, 2**31 - 1, (8192,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    bits = bits[torch.isfinite(bits)]
    return torch.cat([torch.tensor(vals, dtype=torch.float32), rnd, bits])


@pytest.mark.parametrize("od", ["bf16", "f16"])
def test_output_bits_equal_torch_cast(isa, od):
    """Fused output equals master.to(dtype) bit for bit (round to nearest even)."""
    target = _specials()
    n = target.numel()
    # With lr=0 and no decay, the update leaves p unchanged, so out == round(p).
    p = target.clone()
    m, v = torch.zeros(n), torch.ones(n)
    out = torch.empty(n, dtype=DTYPES[od])
    kernels.adam_step([p], [torch.zeros(n)], [m], [v], None, [1], lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.0, decoupled=True, outs=[out])
    assert torch.equal(p, target)
    expect = target.to(DTYPES[od])
    assert torch.equal(out.view(torch.int16), expect.view(torch.int16))


@pytest.mark.parametrize("od", ["bf16", "f16", "f32"])
def test_nonfinite_inputs_match_reference_bitwise(isa, od):
    """NaN payloads and signs, infinities and subnormals take the same path in every ISA as in the
    scalar reference: master, moments and the low-precision copy equal bit for bit (NaN -> the
    canonical 0x7FC0 bf16 / 0x7E00 | sign f16 of the reference)."""
    n = 4133
    for vi, variant in enumerate(VARIANTS[::3]):
        p, g = nonfinite_inputs(n, seed=vi)
        state = make_state(n, torch.float32, DTYPES[od], seed=vi)
        state[0], state[4] = p, g
        ref = clone(state)
        run(state, variant)
        run(ref, variant, reference=True)
        assert_bitwise(state, ref)


def test_nan_output_is_nan(isa):
    p = torch.tensor([float("nan")] * 17)
    for od in ("bf16", "f16"):
        out = torch.empty(17, dtype=DTYPES[od])
        kernels.adam_step([p.clone()], [torch.zeros(17)], [torch.zeros(17)], [torch.ones(17)], None, [1], lr=0.0,
                          beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, outs=[out])
        assert torch.isnan(out.float()).all()


@pytest.mark.parametrize("gd", ["f32", "bf16", "f16"])
def test_grad_input_conversion_exact(isa, gd):
    """A low-precision gradient is widened exactly: same update as its fp32 upcast."""
    g = (_specials()[:20000] * 1e-3).to(DTYPES[gd])
    g = torch.where(torch.isfinite(g.float()), g, torch.zeros_like(g))
    n = g.numel()
    a = [torch.zeros(n), torch.zeros(n), torch.zeros(n)]
    b = [torch.zeros(n), torch.zeros(n), torch.zeros(n)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    kernels.adam_step([a[0]], [g], [a[1]], [a[2]], None, [1], **kw)
    kernels.adam_step([b[0]], [g.float()], [b[1]], [b[2]], None, [1], **kw)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _float64_adam(p, grads, decoupled, amsgrad, wd, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    p = p.double().clone()
    m = torch.zeros_like(p); v = torch.zeros_like(p); vm = torch.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g.double()
        if wd:
            if decoupled:
                p = p * (1 - lr * wd)
            else:
                g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vm = torch.maximum(vm, v)
        vv = vm if amsgrad else v
        p = p - lr / (1 - b1 ** t) * m / ((vv / (1 - b2 ** t)).sqrt() + eps)
    return p


@pytest.mark.parametrize("p_scale", [1.0, 1e-4])  # 1e-4: the update dominates p, so the denominator's rounding shows
@pytest.mark.parametrize("decoupled,amsgrad,wd", [(True, False, 0.01), (False, True, 0.01), (True, True, 0.0)])
def test_error_vs_float64_no_worse_than_torch(isa, decoupled, amsgrad, wd, p_scale):
    n, steps = 65537, 200  # enough elements that the norm of the error is not one rounding's luck
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(n, generator=gen) * p_scale
    grads = [torch.randn(n, generator=gen) * (1 + 0.01 * t) for t in range(steps)]
    exact = _float64_adam(p0, grads, decoupled, amsgrad, wd)

    ours = p0.clone(); m = torch.zeros(n); v = torch.zeros(n); vm = torch.zeros(n)
    for t, g in enumerate(grads, 1):
        kernels.adam_step([ours], [g], [m], [v], [vm], [t], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=wd, decoupled=decoupled, amsgrad=amsgrad)
    tp = p0.clone().requires_grad_()
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([tp], lr=1e-3, weight_decay=wd, amsgrad=amsgrad,
                                                                 foreach=False)
    for g in grads:
        tp.grad = g.clone()
        opt.step()
    err_ours = ((ours.double() - exact).norm() / exact.norm()).item()
    err_torch = ((tp.detach().double() - exact).norm() / exact.norm()).item()
    print(f"float64 error over {steps} steps: ours {err_ours:.3e}, torch {err_torch:.3e}")
    assert err_ours <= err_torch * 1.01 + 1e-12, (err_ours, err_torch)  # measured 0.999-1.004x


def test_grad_sumsq_matches_and_is_deterministic():
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(n, generator=gen) for n in (0, 1, 17, 70_000, 200_003)] + \
            [torch.randn(4097, generator=gen).to(torch.bfloat16), torch.randn(33, generator=gen).half()]
    expect = sum(float((g.double() ** 2).sum()) for g in grads)
    vals = set()
    kernels.set_num_threads(max(7, kernels.get_num_threads()))
    for threads in (1, 2, 3, 7):
        vals.add(kernels.grad_sumsq(grads, threads=threads))
    assert len(vals) == 1
    assert abs(vals.pop() - expect) <= 1e-12 * expect


def test_grad_sumsq_nonfinite(isa):
    for bad in (float("inf"), float("-inf"), float("nan")):
        g = torch.randn(1001)
        g[537] = bad
        assert not np.isfinite(kernels.grad_sumsq([g]))
        assert not np.isfinite(kernels.grad_sumsq([g.to(torch.bfloat16)]))
