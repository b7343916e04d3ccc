"""test_store_semantics.py: NVMe and mmap optimizer state (offload/store.py through offload.Adam/AdamW) give
the in-RAM results bit for bit: over many steps and small budgets, buffered I/O, parameters split over
buckets, state_dict round trips and resume (also through torch.optim.AdamW), partial loads, loaded
hyperparameters and schedulers."""
import pytest
import torch

import offload
from offload.testing import pieces_of, tier
from offload.store import parse_size
from conftest import configs
from store_util import assert_same, make_opt, make_params, reference, run_steps  # noqa: F401 (a fixture)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(sides=("host",), tiers=("nvme", "mmap"), moments=("fp32",)))
@pytest.mark.parametrize("budget,depth", [(16384, 1), (64 * 1024, 3), ("2GiB", 2)])
def test_bitwise_identical_to_ram(tmp_path, reference, cfg, budget, depth):
    ps = make_params()
    opts = {"depth": depth} if cfg.tier == "nvme" else {}
    opt = make_opt(ps, storage=cfg.tier, nvme_dir=tmp_path, host_budget=budget, nvme_options=opts)
    info = opt.storage_info()
    if budget != "2GiB":  # budget below the state size: many buckets, several in flight
        assert info["buckets"] > 4 and info["slot_bytes"] * info["slots"] <= parse_size(budget)
    elif cfg.tier == "nvme":  # a big budget is not allocated beyond the largest bucket
        assert tier(opt).arena.nbytes < 1 << 20
    run_steps(ps, opt, 12)
    assert_same(*reference, ps, opt.state_dict())
    if cfg.tier == "nvme":
        assert opt.storage_info()["engine"]["errors"] == 0
    opt.close()


@pytest.mark.timeout(60)
def test_adam_class_and_buffered_io(tmp_path):
    ps_r, ps_n = make_params(2), make_params(2)
    ram, nv = make_opt(ps_r, offload.Adam), make_opt(ps_n, offload.Adam, storage="nvme", nvme_dir=tmp_path,
                                                     host_budget=32768, nvme_options={"direct": False})
    run_steps(ps_r, ram, 6)
    run_steps(ps_n, nv, 6)
    assert_same(ps_r, ram.state_dict(), ps_n, nv.state_dict())
    assert nv.storage_info()["direct"] is False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(sides=("host",), tiers=("nvme", "mmap"), moments=("fp32",)))
def test_state_dict_round_trip_and_resume(tmp_path, cfg):
    ps_a, ps_r = make_params(3), make_params(3)
    a = make_opt(ps_a, storage=cfg.tier, nvme_dir=tmp_path, host_budget=20480)
    r = make_opt(ps_r)
    run_steps(ps_a, a, 4)
    run_steps(ps_r, r, 4)
    sd = a.state_dict()
    torch.save(sd, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt")
    # resume into a fresh NVMe optimizer and into a RAM optimizer; both continue identically
    ps_b = [p.clone() for p in ps_a]
    b = make_opt(ps_b, storage=cfg.tier, nvme_dir=tmp_path, host_budget=20480)
    b.load_state_dict(loaded)
    run_steps(ps_b, b, 5, start=4)
    run_steps(ps_r, r, 5, start=4)
    assert_same(ps_r, r.state_dict(), ps_b, b.state_dict())
    for o in (a, b):
        o.close()


@pytest.mark.timeout(60)
def test_state_loads_into_torch_adamw_and_back(tmp_path):
    g = torch.Generator().manual_seed(5)
    ps = [torch.randn(300, generator=g), torch.randn(17, 3, generator=g)]
    ps_t = [p.clone() for p in ps]
    opt = offload.AdamW(ps, lr=1e-2, storage="nvme", nvme_dir=tmp_path, host_budget=16384)
    for s in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    sd = opt.state_dict()
    t = torch.optim.AdamW(ps_t, lr=1e-2)
    t.load_state_dict(sd)  # torch's own loader accepts the layout
    assert torch.equal(t.state[ps_t[1]]["exp_avg_sq"], sd["state"][1]["exp_avg_sq"])
    # and torch's state loads back into an NVMe optimizer
    ps2 = [p.clone() for p in ps]
    back = offload.AdamW(ps2, lr=1e-2, storage="nvme", nvme_dir=tmp_path, host_budget=16384)
    back.load_state_dict(t.state_dict())
    sd2 = back.state_dict()
    for k in (0, 1):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sd2["state"][k][key], sd["state"][k][key])


@pytest.mark.timeout(60)
def test_large_param_split_over_buckets(tmp_path):
    g = torch.Generator().manual_seed(6)
    ps = [torch.randn(10007, generator=g).bfloat16(), torch.randn(5003, generator=g)]
    ps_r = [p.clone() for p in ps]
    nv = offload.AdamW(ps, storage="nvme", nvme_dir=tmp_path, host_budget=4 * 4096)
    ram = offload.AdamW(ps_r)
    assert len(pieces_of(nv, ps[0])) > 10  # one parameter, many buckets
    for s in range(4):
        for a, b in zip(ps, ps_r):
            a.grad = torch.randn(a.shape, generator=g).to(a.dtype)
            b.grad = a.grad.clone()
        nv.step()
        ram.step()
    assert_same(ps_r, ram.state_dict(), ps, nv.state_dict())


@pytest.mark.timeout(30)
def test_params_that_fit_a_bucket_are_not_split(tmp_path):
    # 4 slots of 16 KiB: 1360 fp32 elements of master|m|v per bucket; each 1000-element param fits alone
    ps = [torch.randn(1000).bfloat16() for _ in range(5)] + [torch.randn(3000).bfloat16()]
    opt = offload.AdamW(ps, storage="nvme", nvme_dir=tmp_path, host_budget=4 * 16384)
    assert all(len(pieces_of(opt, p)) == 1 for p in ps[:5])
    assert len(pieces_of(opt, ps[5])) == 3  # larger than a bucket: split
    for p in ps:
        p.grad = torch.randn(p.shape).bfloat16()
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"][:] = 7.0  # a view of the file (not a copy): the store sees the change
    sd["state"][5]["exp_avg"][:] = 7.0  # split parameter: its page-aligned pieces mapped side by side, a view too
    again = opt.state_dict()
    assert (again["state"][0]["exp_avg"] == 7.0).all() and (again["state"][5]["exp_avg"] == 7.0).all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(sides=("host",), tiers=("nvme", "mmap"), moments=("fp32",)))
def test_load_partial_state_resets_the_others_like_ram(tmp_path, cfg):
    # a saved state without some parameters: those start afresh, exactly as in RAM mode
    ps_r, ps_n = make_params(7), make_params(7)
    ram = make_opt(ps_r)
    nv = make_opt(ps_n, storage=cfg.tier, nvme_dir=tmp_path, host_budget=20480)
    run_steps(ps_r, ram, 3)
    run_steps(ps_n, nv, 3)
    sd = ram.state_dict()
    for k in (1, 2, 5):
        del sd["state"][k]
    ram.load_state_dict(sd)
    nv.load_state_dict(sd)
    assert_same(ps_r, ram.state_dict(), ps_n, nv.state_dict())
    run_steps(ps_r, ram, 3, start=3)
    run_steps(ps_n, nv, 3, start=3)
    assert_same(ps_r, ram.state_dict(), ps_n, nv.state_dict())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(sides=("host",), tiers=("nvme", "mmap"), moments=("fp32",)))
def test_hyperparameters_follow_loaded_groups_and_schedulers(tmp_path, cfg):
    # load_state_dict replaces the group dicts; the store must use the live ones (lr from the
    # checkpoint, then from the scheduler)
    ps_r, ps_n = make_params(8), make_params(8)
    ram = make_opt(ps_r)
    nv = make_opt(ps_n, storage=cfg.tier, nvme_dir=tmp_path, host_budget=20480)
    run_steps(ps_r, ram, 2)
    run_steps(ps_n, nv, 2)
    sd = ram.state_dict()
    sd["param_groups"][0]["lr"] = 0.05
    sd["param_groups"][2]["weight_decay"] = 0.3
    ram.load_state_dict(sd)
    nv.load_state_dict(sd)
    sr = torch.optim.lr_scheduler.StepLR(ram, step_size=1, gamma=0.5)
    sn = torch.optim.lr_scheduler.StepLR(nv, step_size=1, gamma=0.5)
    for s in range(3):
        run_steps(ps_r, ram, 1, start=2 + s)
        run_steps(ps_n, nv, 1, start=2 + s)
        sr.step()
        sn.step()
    assert_same(ps_r, ram.state_dict(), ps_n, nv.state_dict())
    for o in (ram, nv):   # an edited params list: the state is laid out again, every entry kept
        o.param_groups[0]["params"] = o.param_groups[0]["params"][:1]
    run_steps(ps_r, ram, 1, start=9)
    run_steps(ps_n, nv, 1, start=9)
    for a, b in zip(ps_r, ps_n):   # (state_dict() raises for the entries left, as torch's does)
        assert torch.equal(a, b)
        assert all(torch.equal(ram.state[a][k], nv.state[b][k]) for k in ("exp_avg", "exp_avg_sq"))
