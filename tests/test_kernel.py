# test_kernel.py: the native Adam kernel, every forced ISA path x grad dtype x output dtype x
# variant, against the plain scalar reference (bitwise: all paths do the same IEEE operations
# in the same order with FMA contraction disabled), against float64 math, and across thread counts.
import itertools

import numpy as np
import pytest
import torch

from offload import _C, kernels

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
SIZES = [0, 1, 15, 16, 17, 63, 4097]
# (decoupled, amsgrad, maximize, weight_decay): Adam and AdamW x every flag combination
VARIANTS = [(d, a, m, wd) for d in (True, False) for a in (False, True) for m in (False, True) for wd in (0.0, 0.1)]


def make_state(n, gdtype, odtype, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    vmax = v + torch.rand(n, generator=gen) * 0.01
    g = (torch.randn(n, generator=gen) * 3).to(gdtype)
    out = torch.empty(n, dtype=odtype) if odtype is not None else None
    return [p, m, v, vmax, g, out]


def run(state, variant, step=3, reference=False, threads=0, mult=1.0, lr=1e-2):
    p, m, v, vmax, g, out = state
    decoupled, amsgrad, maximize, wd = variant
    kernels.adam_step([p], [g], [m], [v], [vmax], [step], lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=wd, decoupled=decoupled, amsgrad=amsgrad, maximize=maximize,
                      grad_multiplier=mult, outs=[out] if out is not None else None,
                      threads=threads, reference=reference)


def clone(state):
    return [t.clone() if t is not None else None for t in state]


def assert_bitwise(a, b):
    for x, y in zip(a, b):
        if x is None:
            continue
        assert torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                           y.view(torch.int16 if y.element_size() == 2 else torch.int32))


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
def test_bitwise_identical_across_thread_counts(threads):
    n = 300_007  # several chunks per thread, odd tail
    base = make_state(n, torch.bfloat16, torch.bfloat16, seed=1)
    one = clone(base)
    run(one, VARIANTS[3], threads=1)
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


def nonfinite_inputs(n, seed):
    """(p, g): randn, with NaNs of both signs and assorted payloads, infinities, subnormals and signed
    zeros at scattered places, never a NaN in both at one element (which of two NaNs an IEEE
    operation returns is up to the compiler's operand order)."""
    gen = torch.Generator().manual_seed(seed)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    words = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFA12345, 0x7F800000, 0xFF800000, 0x00000001,
             0x807FFFFF, 0x80000000, 0x00000000]
    special = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32).view(torch.float32)
    where = torch.randperm(n, generator=gen)[: 2 * (n // 5)]
    half = where.numel() // 2
    for t, idx in ((p, where[:half]), (g, where[half:])):
        t[idx] = special[torch.randint(len(words), (idx.numel(),), generator=gen)]
    return p, g


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


# ---- the native layer's own checks (a wrong call must raise, never write out of bounds) ----

def _table(rows):
    return np.asarray(rows, dtype=np.int64).reshape(-1, 10)


def _call(table, **kw):
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, amsgrad=False,
                maximize=False, grad_multiplier=1.0, threads=0, reference=False)
    args.update(kw)
    _C._adam_step(table, **args)


def test_native_rejects_bad_tables():
    p, m, v, g = (torch.zeros(8) for _ in range(4))
    good = [p.data_ptr(), m.data_ptr(), v.data_ptr(), 0, g.data_ptr(), 0, 8, 1, 1, 0]
    _call(_table(good))
    bad_rows = {
        "null param": [0] + good[1:],
        "negative length": good[:6] + [-1] + good[7:],
        "step 0": good[:7] + [0] + good[8:],
        "bad gdtype": good[:8] + [9, 0],
        "bad odtype": good[:9] + [7],
        "out null": good[:9] + [2],
        "overlap": [p.data_ptr(), p.data_ptr() + 4] + good[2:],
    }
    for what, row in bad_rows.items():
        with pytest.raises(ValueError):
            _call(_table(row))
    with pytest.raises(ValueError):
        _call(_table(good), amsgrad=True)  # vmax missing
    with pytest.raises(ValueError):
        _call(np.zeros((1, 9), dtype=np.int64))
    with pytest.raises(ValueError):
        _call(np.zeros((1, 10), dtype=np.int32))
    with pytest.raises(ValueError):
        _call(np.zeros((10, 2), dtype=np.int64).T)
    for kw in (dict(lr=float("nan")), dict(lr=-1.0), dict(beta1=1.0), dict(beta2=-0.1), dict(eps=-1.0),
               dict(weight_decay=float("inf")), dict(grad_multiplier=float("nan")), dict(threads=-1)):
        with pytest.raises(ValueError):
            _call(_table(good), **kw)


def test_tensor_api_rejects_bad_tensors():
    n = 16
    ok = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    with pytest.raises(RuntimeError, match="elements"):
        kernels.adam_step([p], [torch.zeros(n + 1)], [m], [v], None, [1], **ok)
    with pytest.raises(TypeError, match="dtype"):
        kernels.adam_step([p], [torch.zeros(n, dtype=torch.float64)], [m], [v], None, [1], **ok)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.adam_step([p], [torch.zeros(n, 2)[:, 0]], [m], [v], None, [1], **ok)
    with pytest.raises(ValueError, match="steps"):
        kernels.adam_step([p], [torch.zeros(n)], [m], [v], None, [0], **ok)


def test_isa_selection():
    assert kernels.available_isas()[0] == "scalar"
    with pytest.raises(ValueError):
        kernels.set_isa("sse9")
    prev = kernels.get_isa()
    try:
        for name in kernels.available_isas():
            kernels.set_isa(name)
            assert kernels.get_isa() == name
    finally:
        kernels.set_isa(prev)


# ---- environment and process handling ----
import os
import subprocess
import sys


def _py(code, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)


def test_offload_isa_env_forces_path():
    for name in kernels.available_isas():
        r = _py("import offload; print(offload.build_info()['isa'])", {"OFFLOAD_ISA": name})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == name
    r = _py("import offload", {"OFFLOAD_ISA": "neon9"})
    assert r.returncode != 0 and "OFFLOAD_ISA" in r.stderr


def test_default_threads_follow_affinity_mask():
    code = ("import os; os.sched_setaffinity(0, {0}); import offload; "
            "print(offload.build_info()['threads'], offload.build_info()['affinity_cpus'])")
    r = _py(code, {"OFFLOAD_NUM_THREADS": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "1"]


@pytest.mark.timeout(60)
def test_kernel_works_in_forked_child():
    """The pool is recreated after fork(); a child must not wait for workers it does not have.

    The child touches torch only through .numpy() views: torch's own OpenMP pool is not
    fork-safe (a forked child hangs in any parallel torch op), which is not ours to test.
    """
    base = make_state(200_003, torch.float32, None, seed=2)
    expect, got = clone(base), clone(base)
    run(expect, VARIANTS[0], threads=2)  # parent pool is running
    views = [t.numpy() for t in expect[:4]], [t.numpy() for t in got[:4]]
    pid = os.fork()
    if pid == 0:  # child
        code = 4
        try:
            run(got, VARIANTS[0], threads=2)
            code = 0 if all(np.array_equal(x, y) for x, y in zip(*views)) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


# ---- threads above the pool size (issue 10 item 1): the work must still be covered in full ----

@pytest.fixture
def pool_of_two():
    prev = kernels.get_num_threads()
    kernels.set_num_threads(2)
    try:
        yield 2
    finally:
        kernels.set_num_threads(prev)


@pytest.mark.parametrize("extra", [1, 5])
def test_threads_above_pool_size_update_every_element(pool_of_two, extra):
    import offload
    n = 1 << 20
    assert offload.build_info()["threads"] == pool_of_two
    gen = torch.Generator().manual_seed(8)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    results = []
    for threads in (1, pool_of_two + extra):
        p = torch.nn.Parameter(p0.clone())
        p.grad = g.clone()
        opt = offload.AdamW([p], lr=1e-2, threads=threads)
        opt.step()
        opt.clip_grad_norm_(0.5)
        opt.step()
        results.append(p.detach().clone())
    assert not torch.equal(results[0], p0)
    assert torch.equal(results[1].view(torch.int32), results[0].view(torch.int32))


@pytest.mark.parametrize("extra", [1, 5])
def test_raw_entry_points_cover_all_work_above_pool_size(pool_of_two, extra):
    threads = pool_of_two + extra
    n = 300_007
    base = make_state(n, torch.bfloat16, torch.bfloat16, seed=4)
    one, many = clone(base), clone(base)
    run(one, VARIANTS[0], threads=1)
    run(many, VARIANTS[0], threads=threads)
    assert_bitwise(many, one)
    grads = [torch.ones(n), torch.ones(70_001, dtype=torch.bfloat16)] + [torch.ones(1 << 16)] * 9
    expect = float(n + 70_001 + 9 * (1 << 16))
    assert kernels.grad_sumsq(grads, threads=threads) == expect == kernels.grad_sumsq(grads, threads=1)
    bufs = [torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.ones(n)]
    _C._bandwidth_probe(*(b.data_ptr() for b in bufs), n, threads)
    assert torch.equal(bufs[0], torch.full((n,), 0.5)) and torch.equal(bufs[1], torch.ones(n))
    assert torch.equal(bufs[2], -torch.ones(n))


def test_state_arena_streams_not_a_power_of_two_apart():
    """exp_avg, exp_avg_sq and the fp32 master of one arena must not be congruent modulo 4 KiB:
    streams a large power of two apart contend for the same cache sets and DRAM banks (a 128M
    step took 1.9x as long on an AVX2 EPYC; issue 11)."""
    import offload
    ps = [torch.nn.Parameter(torch.zeros(1 << 16, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(1 << 12))]
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt = offload.AdamW(ps, amsgrad=True)
    opt.step()
    for p in ps:
        st = opt.state[p]
        ptrs = [st[k].data_ptr() for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param") if k in st]
        assert len(ptrs) >= 3
        for a, b in itertools.combinations(ptrs, 2):
            assert (a - b) % 4096 != 0, (a, b)
