# test_fallback_tiers.py: the parameters offload's native kernel cannot take (float64, complex,
# non-contiguous, listed twice) with storage="nvme"|"mmap" and compressed moments: stepped by torch's
# own code with their state in host RAM (offload/optim/fallback.py), bitwise the RAM tier's results through
# clipping, add_param_group, state_dict from torch, offload.save/load, a step that raises; where their
# state lives is logged, and a large host-RAM state warns once.
import logging
import warnings

import pytest
import torch

import offload
from offload.optim import fallback
from conftest import Config, configs


def listed(*rows):
    """configs(...) of host parameters: these "tier-moments" rows only."""
    return configs(sides=("host",), moments=("fp32", "8bit"), cover="listed",
                   include=[("host", *r.split("-")) for r in rows])


def kw_of(cfg, tmp_path):
    """The keywords of ``cfg`` (host parameters), compressed moments from 16 elements on."""
    if cfg.tier != "ram":
        tmp_path.mkdir(parents=True, exist_ok=True)
    kw = {} if cfg.tier == "ram" else dict(storage=cfg.tier, nvme_dir=tmp_path)
    return dict(kw, moments=cfg.moments, moments_min_size=16) if cfg.moments != "fp32" else kw


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)

    def P(*shape, dtype=torch.float32):
        return torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype))
    dup = P(40)
    return [P(3, 4, dtype=torch.float64), torch.nn.Parameter(torch.randn(5, dtype=torch.complex64, generator=g)),
            P(64), torch.nn.Parameter(P(8, 6).data.t()), dup, P(32, dtype=torch.bfloat16), dup]


def set_grads(ps, s):
    g = torch.Generator().manual_seed(100 + s)
    for p in {id(p): p for p in ps}.values():
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)


def train(ps, opt, steps, start=0, clip=None):
    for s in range(start, start + steps):
        set_grads(ps, s)
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()


def quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # torch's duplicate-parameter warning
        return fn(*a, **k)


def same(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), i


@pytest.mark.parametrize("cfg", listed("nvme-fp32", "mmap-fp32", "ram-8bit", "nvme-8bit"))
def test_bitwise_the_ram_tier_with_clipping_and_add_param_group(cfg, tmp_path):
    runs = []
    for t in (Config(moments=cfg.moments), cfg):   # the RAM tier's run, then this one
        ps = make_params()
        g = torch.Generator().manual_seed(7)
        extra = [torch.nn.Parameter(torch.randn(6, dtype=torch.float64, generator=g)),
                 torch.nn.Parameter(torch.randn(20, generator=g))]
        opt = quiet(offload.AdamW, ps, lr=0.01, weight_decay=0.1, **kw_of(t, tmp_path / t.id))
        train(ps, opt, 2, clip=0.5)
        opt.add_param_group({"params": extra, "lr": 0.02})
        train(ps + extra, opt, 2, start=2, clip=0.5)
        runs.append((ps + extra, opt))
    (a, oa), (b, ob) = runs
    same(a, b)
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for key in sa[k]:
            assert torch.equal(sa[k][key], sb[k][key]), (k, key)
    # the fused norm includes the gradients torch's code steps (float64, complex, strided, duplicate once)
    set_grads(b, 9)
    exact = sum(float(p.grad.abs().double().pow(2).sum()) for p in {id(p): p for p in b}.values()) ** 0.5
    assert abs(float(ob.clip_grad_norm_(1e9)) - exact) <= 1e-6 * exact
    ob.close()


@pytest.mark.parametrize("cfg", listed("ram-fp32", "nvme-fp32", "mmap-fp32", "ram-8bit", "nvme-8bit"))
def test_checkpoint_and_torch_state_dict_resume_bitwise(cfg, tmp_path):
    ps = make_params()
    ref = quiet(offload.AdamW, ps, lr=0.01, **kw_of(cfg, tmp_path / "a"))
    train(ps, ref, 6)
    ps2 = make_params()
    opt = quiet(offload.AdamW, ps2, lr=0.01, **kw_of(cfg, tmp_path / "b"))
    train(ps2, opt, 3)
    offload.save(opt, tmp_path / "ckpt")
    weights = [p.detach().clone() for p in ps2]
    opt.close()
    ps3 = make_params(seed=1)
    with torch.no_grad():
        for p, w in zip(ps3, weights):
            p.copy_(w)
    back = quiet(offload.AdamW, ps3, lr=0.01, **kw_of(cfg, tmp_path / "c"))
    offload.load(back, tmp_path / "ckpt")
    train(ps3, back, 3, start=3)
    same(ps, ps3)
    if cfg.moments == "8bit":
        return
    # torch.optim's state_dict (the fallback parameters' state under their indices) loads and continues
    ps4, ps5 = make_params(), make_params()
    theirs = quiet(torch.optim.AdamW, ps4, lr=0.01)
    train(ps4, theirs, 3)
    mine = quiet(offload.AdamW, ps5, lr=0.01, **kw_of(cfg, tmp_path / "d"))
    mine.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        for p, q in zip(ps5, ps4):
            p.copy_(q)
    train(ps4, theirs, 2, start=3)
    train(ps5, mine, 2, start=3)
    for i in (0, 1, 3, 4):   # torch's code on both sides
        assert torch.equal(ps4[i], ps5[i]), i
        for key, v in theirs.state[ps4[i]].items():
            assert torch.equal(mine.state[ps5[i]][key], v), (i, key)


@pytest.mark.parametrize("cfg", listed("nvme-fp32", "mmap-fp32", "nvme-8bit"))
def test_a_step_that_raises_changes_nothing(cfg, tmp_path):
    ps = make_params()
    opt = quiet(offload.AdamW, ps, lr=0.01, **kw_of(cfg, tmp_path))
    train(ps, opt, 2)
    before = ([p.detach().clone() for p in ps],
              {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt.state_dict()["state"].items()})

    def unchanged():
        same(ps, before[0])
        for k, v in opt.state_dict()["state"].items():
            for kk, vv in v.items():
                assert torch.equal(vv, before[1][k][kk]), (k, kk)
    set_grads(ps, 5)
    ps[0].grad.data = torch.zeros(2, dtype=torch.float64)   # torch's code's parameter: refused before the engine steps
    with pytest.raises(RuntimeError, match="gradient of parameter 0 of group 0"):
        opt.step()
    unchanged()
    set_grads(ps, 5)
    ps[2].grad.data = torch.zeros(3)                        # the engine's parameter: refused before torch's code steps
    with pytest.raises((RuntimeError, ValueError)):
        opt.step()
    unchanged()
    set_grads(ps, 5)
    opt.step()   # usable: the step completes


def test_where_the_state_lives_is_logged_and_a_large_ram_state_warns_once(tmp_path, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="offload.fallback"):
        opt = quiet(offload.AdamW, make_params(), storage="nvme", nvme_dir=tmp_path)
    assert "kept in host RAM in torch's layout, not in the state file (storage='nvme')" in caplog.text
    opt.close()
    monkeypatch.setattr(fallback, "RAM_WARN_BYTES", 100)
    for cfg, n in ((Config(tier="mmap"), 1), (Config(moments="8bit"), 1), (Config(), 0)):
        ps = make_params()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt = offload.AdamW(ps, **kw_of(cfg, tmp_path / cfg.id))
            train(ps, opt, 2)
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]})
            train(ps, opt, 1, start=2)
        got = [str(x.message) for x in w if "of optimizer state in host RAM instead of" in str(x.message)]
        assert len(got) == n, (cfg.id, got)
        opt.close()


@pytest.mark.parametrize("state", ["ram", "nvme"])
def test_parameter_for_torch_sharing_memory_with_a_native_one_is_refused(tmp_path, state):
    """A transposed view stepped by torch's code over the same memory as a flat view stepped natively would
    be updated in another order than torch's: refused by name, before anything changes."""
    base = torch.randn(4, 4)
    p1, p2 = torch.nn.Parameter(base.t()), torch.nn.Parameter(base.view(-1))
    p1.grad, p2.grad = torch.randn(4, 4), torch.randn(16)
    kw = dict(nvme_dir=str(tmp_path)) if state == "nvme" else {}
    before = base.clone()
    with pytest.raises(RuntimeError, match="shares memory with parameter 1 of group 0"):
        opt = offload.AdamW([p1, p2], **kw)   # (with a state file: refused when the layout is made)
        opt.step()
    assert torch.equal(base, before)
