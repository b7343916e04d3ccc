"""Writes to a bf16/fp16 parameter that no version counter sees are honoured, not reverted.

A bf16/fp16 parameter's fp32 master lives apart from it. Writes through ``p.data`` (``p.data.mul_``,
``p.data.copy_``, ``p.data[:k] = x``: old code, EMA, weight clipping) do not move ``p._version``,
so the version checks cannot see them; the next step used to overwrite them with round(master).
The kernel now compares the parameter with round(master) element by element before each update
(csrc/common.h kBF16Sync/kF16Sync): where they differ, the master takes the user's value, as
torch's AdamW would step from it. Covered: every ISA path and the thread counts bitwise against the
scalar reference (NaN, -0 and out-of-range writes included), and the optimizer in every state mode
bitwise equal to the same write made visibly (``p.mul_()`` under no_grad, which the version check
re-reads).
"""
import tempfile

import numpy as np
import pytest
import torch

import offload
from offload import _C
from offload.native import adam as _kernels
from offload.native.adam import (COL_G, COL_GD, COL_M, COL_N, COL_OD, COL_OUT, COL_P, COL_STEP, COL_V, DTYPE_CODES,
                                 OUT_USER_PARAM, TASK_COLS)

LOWP = [torch.bfloat16, torch.float16]
H = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, amsgrad=False,
         maximize=False)


def _state(n, dt, seed):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    g = torch.randn(n, generator=gen).to(dt)
    out = master.to(dt)                               # in sync: out == round(master)
    k = torch.randperm(n, generator=gen)[: max(1, n // 3)]   # a third of the elements written by the user
    out[k] = (torch.randn(len(k), generator=gen) * 4).to(dt)
    special = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), 70000.0]).to(dt)[: len(k)]
    out[k[: len(special)]] = special
    return [master, m, v, g, out]


def _step(st, reference, threads):
    master, m, v, g, out = st
    t = np.zeros((1, TASK_COLS), dtype=np.int64)
    t[0, COL_P], t[0, COL_M], t[0, COL_V], t[0, COL_G] = (x.data_ptr() for x in (master, m, v, g))
    t[0, COL_OUT], t[0, COL_N], t[0, COL_STEP] = out.data_ptr(), master.numel(), 3
    t[0, COL_GD], t[0, COL_OD] = DTYPE_CODES[g.dtype], OUT_USER_PARAM[out.dtype]
    _C._adam_step(t, H["lr"], H["beta1"], H["beta2"], H["eps"], H["weight_decay"], H["decoupled"], H["amsgrad"],
                  H["maximize"], 1.0, threads, reference)


def _bits(x):
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def _each_isa_and_thread_count():
    before = _kernels.get_isa()
    try:
        for isa in _kernels.available_isas():
            _kernels.set_isa(isa)
            for threads in (1, 2):
                yield isa, threads
    finally:
        _kernels.set_isa(before)


@pytest.mark.parametrize("dt", LOWP)
@pytest.mark.parametrize("n", [1, 7, 8, 33, 1000, 4099])
def test_every_isa_and_thread_count_adopts_user_writes_like_the_reference(dt, n):
    ref = _state(n, dt, seed=n)
    _step(ref, True, 1)
    for isa, threads in _each_isa_and_thread_count():
        st = _state(n, dt, seed=n)
        _step(st, False, threads)
        for a, b in zip(st, ref):
            assert torch.equal(_bits(a), _bits(b)), (isa, threads)


@pytest.mark.parametrize("dt", LOWP)
def test_reference_takes_the_users_value_where_it_differs(dt):
    n = 1000
    st = _state(n, dt, seed=1)
    master0, out0 = st[0].clone(), st[4].clone()
    written = _bits(out0) != _bits(master0.to(dt))
    # what the master must be before the update: the user's value where written, else the master
    start = torch.where(written, out0.float(), master0)
    mirror = [start, st[1].clone(), st[2].clone(), st[3].clone(), start.to(dt)]   # nothing to adopt
    _step(st, True, 1)
    _step(mirror, True, 1)
    assert written.sum() > n // 4
    for a, b in zip(st, mirror):
        assert torch.equal(_bits(a), _bits(b))


def _train(dt, mode, through_data, **opt_kw):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3000).to(dt))
    kw = {} if mode == "ram" else dict(storage=mode, nvme_dir=tempfile.mkdtemp(prefix="offload-uw-"))
    opt = offload.AdamW([p], lr=1e-2, **kw, **opt_kw)
    for s in range(3):
        p.grad = torch.randn(3000).to(dt)
        opt.step()
        with torch.no_grad():
            t = p.data if through_data else p
            t.mul_(0.5)
            t[:10] = 3.0
    p.grad = torch.randn(3000).to(dt)
    opt.step()
    out = p.detach().clone()
    opt.close()
    return out


@pytest.mark.parametrize("mode", ["ram", "nvme", "mmap"])
@pytest.mark.parametrize("dt", LOWP)
def test_writes_through_p_data_are_kept_in_every_state_mode(dt, mode):
    unseen, seen = _train(dt, mode, True), _train(dt, mode, False)
    assert torch.equal(_bits(unseen), _bits(seen))


# ---------------------------------------------------------------- compressed moments (issue 9)
def _q_state(n, dt, fmt, seed):
    from offload.native.moments import moment_state
    master, _, _, g, out = _state(n, dt, seed)
    st = moment_state(n, fmt)
    return master, g, out, st


def _q_step(s, fmt, reference, threads):
    from offload.native.moments import MOMENT_COLS, moment_table, step_moment_table
    master, g, out, st = s
    kw = dict(m_scales=[st["exp_avg_scale"]], v_scales=[st["exp_avg_sq_scale"]]) if fmt == "8bit" else {}
    t = moment_table([master], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [1], fmt=fmt, outs=[out], **kw)
    t[:, MOMENT_COLS["od"]] = OUT_USER_PARAM[out.dtype]
    step_moment_table(t, H, 1.0, threads, reference)


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.parametrize("dt", LOWP)
def test_compressed_moment_kernel_adopts_user_writes_on_every_isa(dt, fmt):
    n = 1000
    ref = _q_state(n, dt, fmt, seed=3)
    master0, out0 = ref[0].clone(), ref[2].clone()
    _q_step(ref, fmt, True, 1)
    # the reference took the user's values: the same as starting from them with nothing to adopt
    written = _bits(out0) != _bits(master0.to(dt))
    start = torch.where(written, out0.float(), master0)
    mirror = (start, ref[1], start.to(dt), _q_state(n, dt, fmt, seed=3)[3])
    _q_step(mirror, fmt, True, 1)
    assert written.sum() > n // 4 and torch.equal(_bits(ref[0]), _bits(mirror[0]))
    for isa, threads in _each_isa_and_thread_count():
        st = _q_state(n, dt, fmt, seed=3)
        _q_step(st, fmt, False, threads)
        for a, b in zip(st[:3], ref[:3]):
            assert torch.equal(_bits(a), _bits(b)), (isa, threads)


@pytest.mark.parametrize("mode", ["ram", "nvme"])
@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_writes_through_p_data_are_kept_with_compressed_moments(fmt, mode):
    kw = dict(moments=fmt, moments_min_size=0)
    unseen, seen = _train(torch.bfloat16, mode, True, **kw), _train(torch.bfloat16, mode, False, **kw)
    assert torch.equal(_bits(unseen), _bits(seen))


def test_adoption_compares_round_master_exactly_at_the_rounding_edges():
    # the vector paths compute round(master) in registers: it must be the reference's rounding at
    # ties (even and odd), at the overflow to inf, for NaNs of any sign and payload and for
    # subnormals, each with the parameter in sync (nothing adopted) and written by the user
    edges = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x7F7F8000, 0xFF7FFFFF, 0x7FC00000,
             0xFFC00000, 0x7FC00001, 0x7F800001, 0xFF800001, 0x7F800000, 0xFF800000, 0x00000001, 0x80008000,
             0x00018000, 0x80000000, 0x00000000, 0x3F800000]
    bits = torch.tensor(edges, dtype=torch.int64).to(torch.int32)
    masters = torch.cat([bits, bits]).view(torch.float32)
    n = masters.numel()
    # what the kernel wrote at its last step: round to nearest even, every NaN as 0x7FC0 (torch's
    # cast writes NaNs differently, so it cannot stand in for it here)
    u = torch.cat([bits, bits]).to(torch.int64) & 0xFFFFFFFF
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    rounded = torch.where(masters.isnan(), torch.full_like(rounded, 0x7FC0), rounded)
    in_sync = rounded.to(torch.int32).to(torch.int16).view(torch.bfloat16)
    for isa, threads in _each_isa_and_thread_count():
        for fill in ("sync", "written"):
            def state():
                gen = torch.Generator().manual_seed(5)
                m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
                g = torch.randn(n, generator=gen).to(torch.bfloat16)
                out = in_sync.clone() if fill == "sync" else torch.full((n,), 0.75).to(torch.bfloat16)
                out[::3] = in_sync[::3]     # some in sync either way
                return [masters.clone(), m, v, g, out]
            ref, st = state(), state()
            _step(ref, True, 1)
            _step(st, False, threads)
            for a, b in zip(st, ref):
                assert torch.equal(_bits(a), _bits(b)), (isa, threads, fill)


def _edge_groups(fill, group=64):
    # masters: each edge value over `group` elements (the quick test covers 32 elements in the fp32
    # loop, 64 in the 8-bit one, 1024 in the bf16-moment one), the whole set four times over (the
    # compressed loops test only where there is room to prefetch behind them); the parameter in sync,
    # with one lane written to a neighbouring value in the first 32 of each edge's elements in the first
    # of the four (lanes 0..31 in turn; the other three stay in sync), or with each lane holding the
    # master's truncated bits (inf where the master is a NaN with a small payload)
    edges = [0x3F807FFF, 0x3F808000, 0x3F808001, 0x3F817FFF, 0x3F818000, 0x7F7FFFFF, 0x7F7F7FFF, 0xFF7FFFFF,
             0x80000000, 0x00000000, 0x80007FFF, 0x00008000, 0x7FC00000, 0x7F800000, 0x3F800000, 0x7F800001,
             0xFF800123]
    bits = torch.tensor(edges * 4, dtype=torch.int64).repeat_interleave(group).to(torch.int32)
    masters = bits.view(torch.float32)
    n = masters.numel()
    u = bits.to(torch.int64) & 0xFFFFFFFF
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    rounded = torch.where(masters.isnan(), torch.full_like(rounded, 0x7FC0), rounded)
    out_bits = rounded.clone() if fill != "truncated" else u >> 16
    if fill not in ("sync", "truncated"):
        starts = torch.arange(0, n // 4, group)
        lanes = starts + (starts // group) % 32
        out_bits[lanes] = {"up": out_bits[lanes] + 1, "down": out_bits[lanes] - 1,
                           "zero": torch.zeros_like(lanes)}[fill] & 0xFFFF
    return masters, out_bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)


EDGE_FILLS = ["sync", "up", "down", "zero", "truncated"]


@pytest.mark.parametrize("fill", EDGE_FILLS)
def test_whole_vector_groups_at_the_rounding_edges_match_the_reference(fill):
    # the AVX2 loops first test a group of vectors at once (no NaN master, each master within 0x7FFF
    # of its parameter's bits) and skip the per-lane check where that passes: groups made of one edge
    # value each (ties, the last values that round to the parameter, max float next to inf, -0 next
    # to +0, NaNs next to inf)
    masters, out = _edge_groups(fill)
    n = masters.numel()

    def state():
        gen = torch.Generator().manual_seed(7)
        m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
        return [masters.clone(), m, v, torch.randn(n, generator=gen).to(torch.bfloat16), out.clone()]
    ref = state()
    _step(ref, True, 1)
    for isa, threads in _each_isa_and_thread_count():
        st = state()
        _step(st, False, threads)
        for a, b in zip(st, ref):
            assert torch.equal(_bits(a), _bits(b)), (isa, threads, fill)


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.parametrize("fill", EDGE_FILLS)
def test_compressed_moment_groups_at_the_rounding_edges_match_the_reference(fmt, fill):
    from offload.native.moments import moment_state
    masters, out = _edge_groups(fill, group=1024 if fmt == "bf16" else 64)
    n = masters.numel()

    def state():
        gen = torch.Generator().manual_seed(8)
        return masters.clone(), torch.randn(n, generator=gen).to(torch.bfloat16), out.clone(), moment_state(n, fmt)
    ref = state()
    _q_step(ref, fmt, True, 1)
    for isa, threads in _each_isa_and_thread_count():
        st = state()
        _q_step(st, fmt, False, threads)
        for a, b in zip(st[:3], ref[:3]):
            assert torch.equal(_bits(a), _bits(b)), (isa, threads, fill)
