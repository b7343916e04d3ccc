"""tests/test_configs.py: the configurations the suite runs over (conftest.py configs/Config/make_opt):
"pairs" holds every pair of values, "all" the product; each Config builds an optimizer that steps."""
import itertools

import pytest
import torch

from offload import testing
from conftest import MOMENTS, SIDES, TIERS, Config, configs


def rows(**kw):
    return [p.values[0] for p in configs(**kw)]


def pairs(cfgs):
    out = set()
    for c in cfgs:
        vals = [("side", c.side), ("tier", c.tier), ("moments", c.moments)] + (
            [("schedule", c.schedule)] if c.schedule else [])
        out |= set(itertools.combinations(vals, 2))
    return out


@pytest.mark.parametrize("kw", [{}, dict(schedules=("eager", "deferred", "sync")), dict(sides=("cpu", "fake")),
                                dict(tiers=("nvme", "mmap"), moments=("fp32", "8bit"))], ids=str)
def test_pairs_cover_every_pair_of_the_product_in_fewer_rows(kw):
    few, every = rows(**kw), rows(cover="all", **kw)
    assert set(few) <= set(every) and len(few) < len(every)
    assert pairs(few) == pairs(every)
    assert len(set(c.id for c in every)) == len(every)   # ids are unique


def test_default_is_the_latin_square_and_all_the_product():
    assert [(c.side, c.tier, c.moments) for c in rows()] == [
        (s, t, m) for s in SIDES for t in TIERS for m in MOMENTS
        if (SIDES.index(s) + TIERS.index(t) - MOMENTS.index(m)) % 3 == 0]
    assert len(rows(cover="all")) == 27 and len(rows(cover="all", schedules=("eager", "deferred", "sync"))) == 63
    assert all(c.schedule is None for c in rows() if c.side == "host")
    with pytest.raises(ValueError):
        configs(cover="some")


@pytest.mark.parametrize("cfg", configs(schedules=("eager", "deferred", "sync")))
def test_every_config_builds_an_optimizer_that_steps_as_configured(cfg, make_opt, tmp_path):
    ps = [torch.nn.Parameter(torch.randn(3000)), torch.nn.Parameter(torch.randn(7, 5))]
    opt = make_opt(cfg, ps, lr=1e-2)
    ref = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in ps], lr=1e-2)
    for _ in range(2):
        for p, q in zip(ps, ref.param_groups[0]["params"]):
            p.grad = torch.ones_like(p)
            q.grad = torch.ones_like(q)
        opt.step()
        ref.step()
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    info = opt.storage_info()
    assert opt.moments == cfg.moments and info["mode"] == cfg.tier
    sched = testing.device_schedule(opt)
    assert (sched and ("sync" if not sched.overlap else "eager" if sched.eager else "deferred")) == cfg.schedule
    if cfg.device:
        assert type(testing.device(opt)).__name__ == {"cpu": "CpuDevice", "fake": "FakeDevice"}[cfg.side]
    assert (info.get("path") or "").startswith(str(tmp_path)) == (cfg.tier != "ram")
    for p, q in zip(ps, ref.param_groups[0]["params"]):
        torch.testing.assert_close(p, q, atol=1e-2 if cfg.moments != "fp32" else 1e-6, rtol=0)
