"""offload.plan: its figures equal what the optimizer really allocates; the CLI prints and exits."""
import json
import os

import pytest
import torch

import offload
from offload.bench.__main__ import main as bench_main


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 40), torch.nn.LayerNorm(40),
                            torch.nn.Linear(40, 7))
    m[3].to(torch.bfloat16)  # bf16 params get an fp32 master copy
    return m


@pytest.mark.timeout(30)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_host_state_matches_allocation(amsgrad):
    model = _model()
    p = offload.plan(model, device="cpu", amsgrad=amsgrad)
    opt = offload.AdamW(model.parameters(), amsgrad=amsgrad)
    for q in model.parameters():
        q.grad = torch.randn_like(q)
    opt.step()
    # what is really allocated: the distinct storages behind the state tensors (arena + step buffer)
    storages = {}
    for st in opt.state.values():
        for t in st.values():
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    # (the arena is allocated with up to 4 KiB more, to align it: allocator slack, never touched)
    assert p.host_state_bytes == sum(storages.values()) - 4096
    views = sum(t.nbytes for st in opt.state.values() for t in st.values())
    # only the padding: 64 bytes per tensor and section, 4 KiB per bucket (fp32 and bf16 parameters)
    assert views <= p.host_state_bytes < views + 64 * 4 * len(opt.state) + 2 * 4096
    assert p.bytes_of("host", "weights") == sum(q.nbytes for q in model.parameters())
    assert p.bytes_of("host", "gradients") == sum(q.grad.nbytes for q in model.parameters())
    assert p.total("gpu") == 0 and p.fits()["host"] is True


@pytest.mark.timeout(30)
def test_nvme_sharding_and_warning():
    p = offload.plan(10_000_000, device="cuda", param_dtype="bf16", storage="nvme", world_size=4, sharding="zero1")
    one = offload.plan(2_500_000, device="cuda", param_dtype="bf16", storage="nvme")  # one rank's quarter
    assert p.bytes_of("nvme", "optimizer state file") == one.bytes_of("nvme", "optimizer state file")
    assert 2_500_000 * 12 <= one.bytes_of("nvme", "optimizer state file") < 2_500_000 * 12 * 1.01  # m, v, master
    assert p.bytes_of("gpu", "weights") == 20_000_000  # ZeRO-1 does not shard weights
    assert any("does not make weights" in w for w in p.warnings)
    f = offload.plan(10_000_000, device="cuda", param_dtype="bf16", world_size=4, sharding="fsdp")
    assert f.bytes_of("gpu", "weights") == 5_000_000


@pytest.mark.timeout(30)
def test_cli(tmp_path, capsys):
    rc = bench_main(["plan", "--params", "2M", "--device", "cpu", "--json", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "optimizer state" in out and "fits" in out
    assert json.loads((tmp_path / "p.json").read_text())["rows"][0]["bytes"] == 4_000_000  # bf16 weights
    assert bench_main(["plan", "--params", "900T", "--device", "cpu"]) == 1  # does not fit: exit 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("amsgrad,budget", [(False, 65536), (True, 1 << 20)])
def test_nvme_figures_match_the_store(tmp_path, amsgrad, budget):
    model = _model()
    p = offload.plan(model, device="cpu", storage="nvme", amsgrad=amsgrad, host_budget=budget)
    opt = offload.AdamW(model.parameters(), amsgrad=amsgrad, storage="nvme", nvme_dir=tmp_path, host_budget=budget)
    try:
        info = opt.storage_info()
        assert p.bytes_of("nvme", "optimizer state file") == info["file_bytes"] == os.path.getsize(info["path"])
        assert p.bytes_of("host", "NVMe bucket buffers") == info["slots"] * info["slot_bytes"]
    finally:
        opt.close()


@pytest.mark.timeout(30)
def test_gpu_mode_figures_match_the_engine(tmp_path):
    """device='cuda' plans are exact for device parameters (driven here by FakeDevice), from the same
    layout code as the engine: RAM state's (unpinned) arena + the pinned staging ring, and NVMe state's
    file, slots and staging ring."""
    from offload.device import FakeDevice
    model = _model()
    for slots in (2, 3):
        p = offload.plan(model, device="cuda", bucket_bytes=1 << 12, staging_slots=slots)
        opt = offload.AdamW(model.parameters(), offload_device=FakeDevice(), bucket_mb=1 / 256,
                            nvme_options={"staging_slots": slots} if slots != 3 else None)
        info = opt.storage_info()
        assert info["pinned"] is False and info["staging_slots"] == slots
        assert p.bytes_of("host", "optimizer state: fp32") == info["arena_bytes"] > 0
        assert p.bytes_of("host", "pinned staging ring") == info["staging_bytes"] > 0
        assert p.bytes_of("host", "pinned") == info["staging_bytes"]   # only the ring is pinned
        opt.close()
    budget = 1 << 20
    p = offload.plan(model, device="cuda", storage="nvme", host_budget=budget, staging_slots=2)
    opt = offload.AdamW(model.parameters(), offload_device=FakeDevice(), storage="nvme", nvme_dir=tmp_path,
                        host_budget=budget, nvme_options={"staging_slots": 2})
    info = opt.storage_info()
    assert p.bytes_of("nvme", "optimizer state file") == info["file_bytes"]
    assert p.bytes_of("host", "NVMe bucket buffers") == info["slots"] * info["slot_bytes"]
    assert p.bytes_of("host", "pinned staging ring") == info["staging_bytes"]
    assert info["slots"] * info["slot_bytes"] + info["staging_bytes"] <= budget
    opt.close()
