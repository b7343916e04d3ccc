"""test_kernel_inputs.py: what the native Adam kernel is given: the native layer's own checks (a wrong
table, tensor or hyperparameter raises, never writes out of bounds), ISA selection and OFFLOAD_ISA, the
default thread count, a forked child, thread counts above the pool size, and where the state streams lie."""
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from offload import _C, kernels
from kernel_util import VARIANTS, assert_bitwise, clone, make_state, run


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
    known = ("scalar", "avx2", "avx512", "neon", "sve128", "sve256", "sve512")
    assert set(kernels.available_isas()) <= set(known)
    with pytest.raises(ValueError, match="expected scalar, avx2, avx512, neon, sve128, sve256, sve512 or auto"):
        kernels.set_isa("sse9")
    prev = kernels.get_isa()
    try:
        for name in kernels.available_isas():
            kernels.set_isa(name)
            assert kernels.get_isa() == name
        # a known ISA this CPU lacks (another architecture's, another SVE length) is refused by name
        # and changes nothing
        for name in sorted(set(known) - set(kernels.available_isas())):
            with pytest.raises(ValueError, match=f"ISA '{name}' is not supported by this CPU"):
                kernels.set_isa(name)
            assert kernels.get_isa() == kernels.available_isas()[-1]
    finally:
        kernels.set_isa(prev)


# ---- environment and process handling ----

def _py(code, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)


def test_offload_isa_and_prefetch_env_set_the_kernel_path(monkeypatch):
    # at import (one interpreter: imports are slow) ...
    best = kernels.available_isas()[-1]
    r = _py("import offload, offload.kernels as k; print(offload.build_info()['isa'], k.get_stream_prefetch())",
            {"OFFLOAD_ISA": best, "OFFLOAD_PREFETCH": "off"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{best} {('off', False)}"
    # ... and every other value through the same function, in this process
    from offload.native import adam as native_adam
    before_isa, before_pf = kernels.get_isa(), kernels.get_stream_prefetch()[0]
    try:
        for k, name in enumerate(kernels.available_isas()):
            mode = ("on", "off")[k % 2]
            monkeypatch.setenv("OFFLOAD_ISA", name)
            monkeypatch.setenv("OFFLOAD_PREFETCH", mode)
            native_adam.init_from_env()
            assert kernels.get_isa() == name and kernels.get_stream_prefetch() == (mode, mode == "on")
        monkeypatch.setenv("OFFLOAD_PREFETCH", "auto")
        for var, bad in (("OFFLOAD_ISA", "neon9"), ("OFFLOAD_PREFETCH", "maybe")):
            monkeypatch.setenv(var, bad)
            with pytest.raises(ImportError, match=var):
                native_adam.init_from_env()
            monkeypatch.delenv(var)
    finally:
        kernels.set_isa(before_isa)
        kernels.set_stream_prefetch(before_pf)


def test_stream_prefetch_setting_changes_no_bit():
    # the fp32 loop with and without software prefetch, every fused pair and a passed one, threads
    # whose ranges start inside a prefetch window: the same bits; the setting is validated
    from kernel_util import DTYPES, VARIANTS, assert_bitwise, clone, make_state, run
    before = kernels.get_stream_prefetch()
    try:
        for gd, od in (("f32", None), ("f32", "f32"), ("bf16", "bf16"), ("f16", "f16")):
            base = make_state(200_003, DTYPES[gd], DTYPES.get(od), seed=3)
            results = []
            for mode in ("on", "off", "auto"):
                kernels.set_stream_prefetch(mode)
                assert kernels.get_stream_prefetch()[0] == mode
                st = clone(base)
                run(st, VARIANTS[3], threads=2)
                results.append(st)
            assert_bitwise(results[0], results[1])
            assert_bitwise(results[0], results[2])
        with pytest.raises(ValueError, match="prefetch"):
            kernels.set_stream_prefetch("sometimes")
    finally:
        kernels.set_stream_prefetch(before[0])


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


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_probe_mode_does_the_same_pass(threads):
    # the bench times each way of walking memory and keeps the fastest: each must touch every element
    # exactly once (a mode that skipped some would make a "ceiling" no kernel can reach honestly)
    from offload.native import adam as native_adam
    n = 3 * (1 << 18) + 12_345  # several 1 MiB tiles per thread and a partial one
    for mode in range(len(native_adam.PROBE_MODES)):
        bufs = [torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.ones(n)]
        native_adam.bandwidth_probe(*bufs, threads=threads, mode=mode)
        assert torch.equal(bufs[0], torch.full((n,), 0.5)) and torch.equal(bufs[1], torch.ones(n)), mode
        assert torch.equal(bufs[2], -torch.ones(n)), mode
    bufs = [torch.zeros(8) for _ in range(4)]
    for bad in (-1, len(native_adam.PROBE_MODES), 1.0):
        with pytest.raises(ValueError, match="mode must be"):
            native_adam.bandwidth_probe(*bufs, mode=bad)
    with pytest.raises(ValueError, match="unknown probe mode"):
        _C._bandwidth_probe(*(b.data_ptr() for b in bufs), 8, 1, 7)


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
