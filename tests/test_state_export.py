"""test_state_export.py: state_dict() of compressed moments in a disk tier decodes into file-backed
memory (offload/engine/export.py), so torch.save(opt.state_dict()) of a state too large for RAM does
not need 8 B per parameter of anonymous memory."""
from __future__ import annotations

import ctypes
import gc
import os

import pytest
import torch

import offload

N = 4 << 20   # 4M elements: 32 MiB of decoded fp32 moments


def _rss_anon() -> int:
    """Anonymous resident memory after handing freed heap memory back (glibc malloc_trim), so
    that only what is still referenced counts."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pytest.skip("no glibc malloc_trim")
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")


@pytest.mark.parametrize("state", ["nvme", "mmap"])
def test_state_dict_decodes_into_file_backed_memory(tmp_path, state):
    g = torch.Generator().manual_seed(0)
    p = torch.randn(N, generator=g)
    opt = offload.AdamW([p], lr=1e-3, moments="8bit", storage=state, nvme_dir=str(tmp_path))
    p.grad = torch.randn(N, generator=g)
    opt.step()
    p.grad = None
    before = _rss_anon()
    sd = opt.state_dict()
    grew = _rss_anon() - before
    st = sd["state"][0]
    assert st["exp_avg"].shape == p.shape and st["exp_avg"].dtype == torch.float32
    # the exported fp32 moments (8 B/param) are file-backed: the anonymous memory still held is small
    assert grew < 2 * N, f"state_dict() grew anonymous RSS by {grew / 2**20:.0f} MiB"
    assert torch.equal(st["exp_avg"], opt.state[p]["exp_avg"])
    assert torch.equal(st["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    # nothing left on disk besides offload's own state files; torch loads the state
    (d,) = [os.path.join(tmp_path, x) for x in os.listdir(tmp_path)]
    assert sorted(os.listdir(d)) == ["owner.json", "state.bin"]
    ref = torch.optim.AdamW([p.detach().clone()], lr=1e-3)
    ref.load_state_dict(sd)
    del sd, st, ref
    opt.close()
    assert os.listdir(tmp_path) == []


def test_ram_tier_state_dict_unchanged():
    p = torch.randn(5000)
    opt = offload.AdamW([p], lr=1e-3, moments="bf16")
    p.grad = torch.randn(5000)
    opt.step()
    sd = opt.state_dict()
    assert torch.equal(sd["state"][0]["exp_avg"], opt.state[p]["exp_avg"])
