# test_kernel_moments.py: the compressed-moment Adam kernel (issue 9; formats in csrc/moments.h):
# every ISA x grad dtype x output dtype x format against the plain scalar reference (bitwise),
# across thread counts (blocks never split), sizes around the 256-element block, the moment
# error against fp32 moments after 100 steps, and bad input refused by name.
import itertools

import numpy as np
import pytest
import torch

from offload import _C, kernels
from offload.native import moments as _moments

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# 8, 23: one and two AVX2 vectors (the pipelined loops); 1280, 1343: the last size whose first block,
# or whose bf16 range, ends exactly where the unrolled groups' prefetches must stop (kQPrefetchAhead
# = 1024 elements ahead), and one with a remainder of 3 AVX-512 vectors + 15 elements after the groups
SIZES = [0, 1, 8, 23, 255, 256, 257, 1280, 1343, 4097]
FORMATS = ["bf16", "8bit"]
# (decoupled, maximize, weight_decay, grad_multiplier, beta1): every flag the kernel specialises on
VARIANTS = [(True, False, 0.01, 1.0, 0.9), (False, True, 0.1, 0.5, 0.9), (True, False, 0.0, 1.0, 0.3),
            (False, False, 0.0, 2.0, 0.9)]


def make(n, fmt, gdtype, odtype, seed, steps_before=0):
    """A state that has seen a few steps (non-trivial scales), plus a fresh gradient."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    st = kernels.moment_state(n, fmt)
    g = (torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))).to(gdtype)
    out = torch.empty(n, dtype=odtype) if odtype is not None else None
    state = dict(p=p, g=g, out=out, **st)
    for s in range(1, steps_before + 1):
        step(state, fmt, VARIANTS[0], s)
    return state


def step(state, fmt, variant, t, threads=0, reference=False):
    decoupled, maximize, wd, mult, beta1 = variant
    q8 = fmt == "8bit"
    kernels.adam_step_moments([state["p"]], [state["g"]], [state["exp_avg"]], [state["exp_avg_sq"]], [t], fmt=fmt,
                              lr=1e-2, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=wd, decoupled=decoupled,
                              maximize=maximize, grad_multiplier=mult,
                              m_scales=[state["exp_avg_scale"]] if q8 else None,
                              v_scales=[state["exp_avg_sq_scale"]] if q8 else None,
                              outs=[state["out"]] if state["out"] is not None else None,
                              threads=threads, reference=reference)


def clone(state):
    return {k: (v.clone() if v is not None else None) for k, v in state.items()}


def assert_bitwise(a, b):
    for k in a:
        if a[k] is None:
            continue
        x, y = a[k], b[k]
        if x.dtype.is_floating_point:
            x = x.view(torch.int16 if x.element_size() == 2 else torch.int32)
            y = y.view(torch.int16 if y.element_size() == 2 else torch.int32)
        assert torch.equal(x, y), k


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gd,od", [("f32", None), ("bf16", "bf16"), ("f16", "f16"), ("f32", "f32"), ("bf16", None)])
def test_isa_matches_reference_bitwise(isa, fmt, n, gd, od):
    for vi, variant in enumerate(VARIANTS):
        state = make(n, fmt, DTYPES[gd], DTYPES.get(od), seed=n * 7 + vi, steps_before=2)
        ref = clone(state)
        step(state, fmt, variant, 3)
        step(ref, fmt, variant, 3, reference=True)
        assert_bitwise(state, ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bitwise_identical_across_thread_counts(fmt):
    n = 300_007
    base = make(n, fmt, torch.bfloat16, torch.bfloat16, seed=1, steps_before=1)
    one = clone(base)
    step(one, fmt, VARIANTS[1], 2, threads=1)
    prev = kernels.get_num_threads()
    kernels.set_num_threads(2)
    try:
        for threads in (2, 3, 7):  # 3 and 7: above the pool size, every block still covered
            many = clone(base)
            step(many, fmt, VARIANTS[1], 2, threads=threads)
            assert_bitwise(many, one)
    finally:
        kernels.set_num_threads(prev)


def test_several_tensors_and_blocks_across_threads():
    """Blocks of several tensors laid end to end: a thread boundary must not split a block."""
    sizes = [1, 300, 70_000, 256 * 129 + 5, 33]
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randn(n, generator=gen) for n in sizes]
    gs = [torch.randn(n, generator=gen) for n in sizes]
    res = []
    for threads in (1, 2):
        sts = [kernels.moment_state(n, "8bit") for n in sizes]
        pp = [p.clone() for p in ps]
        for t in (1, 2):
            kernels.adam_step_moments(pp, gs, [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts],
                                      [t] * len(sizes), fmt="8bit", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                      weight_decay=0.0, decoupled=True, threads=threads,
                                      m_scales=[s["exp_avg_scale"] for s in sts],
                                      v_scales=[s["exp_avg_sq_scale"] for s in sts])
        res.append((pp, sts))
    for a, b in zip(res[0][0], res[1][0]):
        assert torch.equal(a, b)
    for sa, sb in zip(res[0][1], res[1][1]):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def _run_fp32(p0, grads, **kw):
    p = p0.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, 1):
        kernels.adam_step([p], [g], [m], [v], None, [t], **kw)
    return p, m, v


# measured (csrc/moments.h): bf16 m 0.37%, v 0.88%, change 0.27%; 8bit m 2.14%, v 1.96%, change 3.97%
@pytest.mark.parametrize("fmt,tol_m,tol_v,tol_p", [("bf16", 0.01, 0.01, 0.01), ("8bit", 0.03, 0.025, 0.05)])
def test_moment_error_vs_fp32_after_100_steps(fmt, tol_m, tol_v, tol_p):
    """Realistic gradients (a persistent mean plus noise, per-element scales spread log-normally
    within each block): relative error of m, v and of the parameter change vs fp32 moments."""
    n, steps = 1 << 15, 100
    gen = torch.Generator().manual_seed(5)
    scale = torch.exp(torch.randn(n, generator=gen)) * 1e-3
    mean = torch.randn(n, generator=gen) * 0.3
    grads = [(mean + torch.randn(n, generator=gen)) * scale for _ in range(steps)]
    p0 = torch.randn(n, generator=gen)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
    p32, m32, v32 = _run_fp32(p0, grads, **kw)
    st = kernels.moment_state(n, fmt)
    p = p0.clone()
    q8 = fmt == "8bit"
    for t, g in enumerate(grads, 1):
        kernels.adam_step_moments([p], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [t], fmt=fmt, **kw,
                                  m_scales=[st["exp_avg_scale"]] if q8 else None,
                                  v_scales=[st["exp_avg_sq_scale"]] if q8 else None)
    m, v = kernels.decode_moments(st["exp_avg"], st["exp_avg_sq"], fmt, st.get("exp_avg_scale"),
                                  st.get("exp_avg_sq_scale"))
    rel = lambda a, b: float((a - b).norm() / b.norm())
    err_m, err_v, err_p = rel(m, m32), rel(v, v32), rel(p - p0, p32 - p0)
    print(f"{fmt}: rel error m {err_m:.4f}, v {err_v:.4f}, param change {err_p:.4f}")
    assert err_m < tol_m and err_v < tol_v and err_p < tol_p, (err_m, err_v, err_p)
    assert bool((v > 0).all())  # no second moment decoded to 0 (that would make the update m / eps)


def _shr1(x):
    return torch.from_numpy((x.numpy().view(np.uint32) >> np.uint32(1)).view(np.float32))


def test_decode_matches_the_kernels_view():
    """decode_moments reads what the kernel wrote: each block's largest code decodes back to its
    scale (shr1 of the decoded magnitude is the stored maximum)."""
    st = make(1000, "8bit", torch.float32, None, seed=9, steps_before=3)
    m, v = kernels.decode_moments(st["exp_avg"], st["exp_avg_sq"], "8bit", st["exp_avg_scale"], st["exp_avg_sq_scale"])
    assert torch.isfinite(m).all() and (v >= 0).all() and m.abs().max() > 0
    for b in range(4):
        sl = slice(256 * b, 256 * (b + 1))
        assert torch.isclose(st["exp_avg_scale"][b], _shr1(m[sl].abs()).max(), rtol=1e-6)
        assert torch.isclose(st["exp_avg_sq_scale"][b], _shr1(v[sl].sqrt()).max(), rtol=1e-6)


@pytest.mark.parametrize("n", [300, 4097])
def test_8bit_codes_follow_the_format_description(isa, n):
    """One step from the zero state, the codes and scales computed here in numpy from the text of
    csrc/moments.h (not from the C++ reference): bitwise equal."""
    gen = torch.Generator().manual_seed(n)
    g = (torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))).numpy()
    g[::7] = 0.0  # zero moments encode as code 0
    st = kernels.moment_state(n, "8bit")
    p = torch.zeros(n)
    kernels.adam_step_moments([p], [torch.from_numpy(g)], [st["exp_avg"]], [st["exp_avg_sq"]], [1], fmt="8bit",
                              lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
                              m_scales=[st["exp_avg_scale"]], v_scales=[st["exp_avg_sq_scale"]])
    f32 = np.float32
    m = f32(1 - 0.9) * g  # zero state: m = 0 + w1 * (g - 0), v = 0 * beta2 + ((1 - beta2) * g) * g
    v = (f32(1 - 0.999) * g) * g
    shr1 = lambda x: (x.view(np.uint32) >> np.uint32(1)).view(np.float32)
    r, u = np.copysign(shr1(np.abs(m)), m), shr1(np.sqrt(v))
    for b in range(-(-n // 256)):
        sl = slice(256 * b, 256 * (b + 1))
        ms, vs = np.abs(r[sl]).max(), u[sl].max()
        assert st["exp_avg_scale"][b].item() == ms and st["exp_avg_sq_scale"][b].item() == vs
        qm = np.rint(r[sl] * np.minimum(f32(127) / ms, f32(3.4028235e38)))
        qv = np.rint(u[sl] * np.minimum(f32(255) / vs, f32(3.4028235e38)))
        assert np.array_equal(st["exp_avg"][sl].numpy(), qm.astype(np.int8))
        assert np.array_equal(st["exp_avg_sq"][sl].numpy(), qv.astype(np.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gd,od", [("f32", "bf16"), ("bf16", "bf16"), ("f32", "f16"), ("f32", "f32")])
def test_nonfinite_inputs_match_reference_bitwise(isa, fmt, gd, od):
    """NaN payloads and signs, infinities and subnormals in the master and the gradient: every ISA
    gives the scalar reference's bits (8-bit: poisoned blocks; bf16: NaN moments -> 0x7FC0)."""
    from kernel_util import nonfinite_inputs

    n = 4133
    for vi, variant in enumerate(VARIANTS):
        state = make(n, fmt, DTYPES[gd], DTYPES[od], seed=vi, steps_before=2)
        p, g = nonfinite_inputs(n, seed=vi)
        state["p"].copy_(p)
        state["g"].copy_(g.to(DTYPES[gd]))
        ref = clone(state)
        step(state, fmt, variant, 3)
        step(ref, fmt, variant, 3, reference=True)
        assert_bitwise(state, ref)


def test_nonfinite_moment_poisons_its_block_only(isa):
    n = 600
    st = make(n, "8bit", torch.float32, None, seed=2, steps_before=1)
    st["g"][300] = float("inf")
    step(st, "8bit", VARIANTS[0], 2)
    sc = st["exp_avg_scale"]
    assert torch.isnan(sc[1]) and torch.isfinite(sc[0]) and torch.isfinite(sc[2])
    ref = make(n, "8bit", torch.float32, None, seed=2, steps_before=1)
    ref["g"][300] = float("inf")
    step(ref, "8bit", VARIANTS[0], 2, reference=True)
    assert_bitwise(st, ref)
    m, v = kernels.decode_moments(st["exp_avg"], st["exp_avg_sq"], "8bit", sc, st["exp_avg_sq_scale"])
    assert torch.isnan(m[256:512]).all() and torch.isnan(v[256:512]).all()
    assert torch.isfinite(m[:256]).all() and torch.isfinite(v[512:]).all()
    step(st, "8bit", VARIANTS[0], 3)  # a poisoned block stays poisoned (decoded NaN, re-encoded NaN)
    step(ref, "8bit", VARIANTS[0], 3, reference=True)
    assert torch.isnan(st["exp_avg_scale"][1]) and torch.isnan(st["p"][256:512]).all()
    assert_bitwise(st, ref)


def test_bad_input_is_refused_by_name():
    n = 300
    st = kernels.moment_state(n, "8bit")
    p, g = torch.zeros(n), torch.zeros(n)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    with pytest.raises(ValueError, match="amsgrad"):
        kernels.adam_step_moments([p], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [1], fmt="8bit", amsgrad=True,
                                  m_scales=[st["exp_avg_scale"]], v_scales=[st["exp_avg_sq_scale"]], **kw)
    with pytest.raises(ValueError, match="unknown moment format"):
        kernels.moment_state(n, "4bit")
    with pytest.raises(ValueError, match="m_scales"):
        kernels.adam_step_moments([p], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [1], fmt="8bit", **kw)
    with pytest.raises(TypeError, match="dtype"):  # bf16 moments given to the 8bit format
        b = kernels.moment_state(n, "bf16")
        kernels.adam_step_moments([p], [g], [b["exp_avg"]], [b["exp_avg_sq"]], [1], fmt="8bit",
                                  m_scales=[st["exp_avg_scale"]], v_scales=[st["exp_avg_sq_scale"]], **kw)
    with pytest.raises(RuntimeError, match="elements"):  # scale vector of the wrong length
        kernels.adam_step_moments([p], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [1], fmt="8bit",
                                  m_scales=[torch.zeros(1)], v_scales=[st["exp_avg_sq_scale"]], **kw)
    # the native layer's own checks
    good = _moments.moment_table([p], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [1], fmt="8bit",
                                m_scales=[st["exp_avg_scale"]], v_scales=[st["exp_avg_sq_scale"]])
    hyper = dict(kw, amsgrad=False, maximize=False)
    _moments.step_moment_table(good, hyper)
    for col, val, what in [(11, 5, "moment format"), (3, 0, "m_scale"), (7, -1, "negative"), (8, 0, "step"),
                           (1, int(good[0, 0]), "overlap"), (10, 2, "output")]:
        bad = good.copy()
        bad[0, col] = val
        with pytest.raises(ValueError, match=what):
            _moments.step_moment_table(bad, hyper)
    with pytest.raises(ValueError, match="shape"):
        _C._adam_step_moments(np.zeros((1, 10), dtype=np.int64), 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, False, 1.0)
    with pytest.raises(ValueError, match="int64"):
        _C._adam_step_moments(np.zeros((1, 12), dtype=np.int32), 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, False, 1.0)
