"""offload/state/layout.py (pure) and the NVMe tier's slot ring, without an optimizer."""
import pytest
import torch

from offload.moments.format import moment_format
from offload.state.layout import ALIGN, ELEM, Shape, build_layout, split_buckets


def _check(lay, shapes, max_state=None, max_param=None):
    covered = {}
    end = 0
    for b in lay.buckets:
        assert b.offset % ALIGN == 0 and b.nbytes % ALIGN == 0 and b.offset >= end
        end = b.offset + b.nbytes
        assert b.state_bytes <= b.nbytes
        if max_state is not None:
            assert b.nbytes <= max(max_state, ALIGN) or len(b.pieces) == 1
        if max_param is not None and len(b.pieces) > 1:
            assert b.stage_bytes <= max_param
        keys = [k for k, _ in b.keys]
        assert keys[-2:] == ["exp_avg", "exp_avg_sq"] or keys[-1] == "max_exp_avg_sq"
        assert ("master_param" in keys) == b.master
        prev = 0
        for pc in b.pieces:
            assert pc.pos % ELEM == 0 and pc.pos >= prev and pc.pos + pc.n <= b.cap
            prev = pc.pos + pc.n
            covered.setdefault((b.group, pc.param), []).append((pc.start, pc.n))
    assert lay.nbytes == end
    for s in shapes:
        got = sorted(covered.get((s.group, s.index), []))
        if not s.active or s.numel == 0:
            assert got == [] and lay.of_param[(s.group, s.index)] == []
            continue
        pos = 0
        for start, n in got:   # pieces tile the parameter exactly once
            assert start == pos
            pos += n
        assert pos == s.numel


SHAPES = [Shape(0, 0, 1000, 4, False), Shape(0, 1, 70000, 2, True), Shape(0, 2, 5, 4, False, active=False),
          Shape(0, 3, 17, 2, True), Shape(1, 0, 300, 4, True), Shape(1, 1, 0, 4, False), Shape(1, 2, 9000, 4, False)]


@pytest.mark.parametrize("max_state", [None, 16384, 65536, 1 << 20])
def test_layout_tiles_every_active_parameter(max_state):
    lay = build_layout(SHAPES, amsgrad=[False, True], max_state_bytes=max_state)
    _check(lay, SHAPES, max_state)
    for b in lay.buckets:
        assert b.amsgrad == (b.group == 1)


def test_split_parameters_have_page_aligned_sections():
    lay = build_layout(SHAPES, amsgrad=[False, False], max_state_bytes=65536)
    entries = lay.of_param[(0, 1)]
    assert len(entries) > 3
    for bi, pc in entries:
        b = lay.buckets[bi]
        assert pc.pos == 0 and len(b.pieces) == 1
        for key, size in b.keys:
            assert (b.offset + b.section(key)) % 4096 == 0
    assert all(pc.n % 1024 == 0 for _, pc in entries[:-1])


def test_parameter_bytes_bound_and_extend():
    lay = build_layout(SHAPES, amsgrad=[False, False], max_param_bytes=4096)
    _check(lay, SHAPES, max_param=4096)
    more = build_layout([Shape(2, 0, 100, 4, True)], amsgrad=[False, False, True])
    n, nb = len(lay.buckets), lay.nbytes
    lay.extend(more)
    assert lay.buckets[-1].index == n and lay.buckets[-1].offset == nb
    assert lay.of_param[(2, 0)][0][0] == n


def test_too_small_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="raise host_budget"):
        build_layout(SHAPES, amsgrad=[True, True], max_state_bytes=100)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["nvme", "mmap", "ram"])
def test_tier_reads_out_of_order_on_demand(tmp_path, kind):
    """Prefetched buckets and buckets acquired out of the expected order (on demand) both read what
    was written; the NVMe ring never uses more than depth + 2 slots."""
    from offload.state import make_tier
    shapes = [Shape(0, i, 1000, 4, False) for i in range(8)]
    lay = build_layout(shapes, amsgrad=[False], max_state_bytes=8192)
    tier = make_tier(kind, nvme_dir=tmp_path, depth=2)
    tier.allocate(lay)
    for k, b in enumerate(lay.buckets):
        tier.write(b, torch.full((b.nbytes,), k, dtype=torch.uint8))
    order = [0, 1, 5, 2, 7, 3, 4, 6]
    for j, k in enumerate(order):
        for nxt in order[j + 1:j + 3]:
            tier.prefetch(lay.buckets[nxt], True)
        tier.prefetch(lay.buckets[(k + 3) % 8], True)   # a read-ahead that guessed wrong
        b = lay.buckets[k]
        blk = tier.acquire(b, True)
        assert (blk.data[:b.nbytes] == k).all(), k
        blk.data[:b.nbytes].fill_(100 + k)
        tier.release(b, blk)
        if kind == "nvme":
            assert len(tier._free) + len(tier._reads) + len(tier._writes) <= 4
    tier.drain()
    view, _ = tier.mapping()
    for k, b in enumerate(lay.buckets):
        assert (view(b.offset, b.nbytes) == 100 + k).all()
    tier.close()
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("budget", [None, 64 << 10, 1 << 20, 4096])
def test_split_buckets_counts_the_pieces_build_layout_makes(budget):
    """split_buckets (the planner's bound, computed without a layout) is the number of buckets
    build_layout gives to the parameters it cuts into pieces (every piece a bucket of its own)."""
    q8, bf16 = moment_format("8bit"), moment_format("bf16")
    shapes = [Shape(0, 0, 10, 4, False), Shape(0, 1, 100_000, 2, True),
              Shape(0, 2, 7, 4, False, active=False),
              Shape(0, 3, 70_001, 4, False, moments=q8), Shape(0, 4, 0, 4, False),
              Shape(1, 0, 300_000, 4, False),
              Shape(1, 1, 5000, 2, True, moments=bf16)]
    for ams in ([False, False], [True, False]):
        lay = build_layout(shapes, amsgrad=ams, max_state_bytes=budget)
        pieces = sum(len(v) for v in lay.of_param.values() if len(v) > 1)
        assert split_buckets(shapes, amsgrad=ams, max_state_bytes=budget) == pieces
        assert (pieces > 0) == (budget is not None)
