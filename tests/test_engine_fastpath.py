"""test_engine_fastpath.py: the state engine's cached per-step checks (params/hostrows.py,
_C.state_rows in engine/torchstate.py) notice every change a user can make between steps.

Host parameters in every tier and moment format that runs on the engine (state ram with bf16/8bit
moments, nvme and mmap with any moments). Each change is made after warm steps (every row cached)
and the result (the exception and its message, or the parameters and step counts, bitwise) must
equal the same run with the caches dropped before every step (every row validated from scratch in
Python, as before the caches existed) and, for fp32 moments, the host fp32 RAM path. Separate tests
break one invalidation rule each: they fail if that rule is not applied.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import offload
from offload import testing
from conftest import configs

SHAPES = [(16, 16), (16, 32), (512,), (256,)]   # 0 and 3, 1 and 2 have the same number of elements
HOST = dict(sides=("host",), cover="all")   # configs(...) of this file: every tier x moment format
FAST = dict(HOST, cover="listed", include=[("host", "ram", "8bit"), ("host", "nvme", "fp32"),
                                          ("host", "mmap", "bf16")])   # one of each tier and moment format


def _make(params, state, moments, tmp_path):
    opts = dict(moments=moments, moments_min_size=300)   # params 1 and 2 compressed, 0 and 3 fp32 moments
    if state != "ram":
        d = tmp_path / f"{state}-{moments}"
        d.mkdir(exist_ok=True)
        opts.update(storage=state, nvme_dir=str(d))
    return offload.AdamW(params, lr=1e-2, weight_decay=0.01, **opts)


def _cold(opt) -> None:
    """Forget every cached record: the next step validates every row in Python."""
    testing.drop_row_caches(opt)


def _g(t, k):
    return (torch.randn(t.shape, generator=torch.Generator().manual_seed(100 + k)) * 0.1).to(t.dtype)


def _swap(ps, opt, k, mem):   # a grad dropped, memory moved onto it, the grad given back
    if k == 0:
        mem["g0"] = ps[0].grad
        ps[0].grad = None
        ps[3].data = mem["g0"].view(-1)    # param 3 now lives in what was param 0's gradient: legal
    else:
        ps[0].grad = mem["g0"]             # ... until that tensor is a gradient again


def _at(k, f):
    return lambda ps, opt, kk, mem: f(ps, opt) if kk == k else None


def _setd(t, f):
    t.data = f(t.data)


CHANGES = {
    # gradients
    "new grad objects": lambda ps, opt, k, mem: [setattr(p, "grad", _g(p, 10 + k + i)) for i, p in enumerate(ps)],
    "grad None": _at(0, lambda ps, opt: setattr(ps[1], "grad", None)),
    "grad None then back": lambda ps, opt, k, mem: setattr(ps[1], "grad", None if k == 0 else mem["g"])
    if mem.setdefault("g", ps[1].grad) is not None else None,
    "grad t_()": _at(0, lambda ps, opt: ps[0].grad.t_()),
    "grad .data t()": _at(0, lambda ps, opt: _setd(ps[0].grad, lambda d: d.t())),
    "grad .data prefix": _at(0, lambda ps, opt: _setd(ps[1].grad, lambda d: d.view(-1)[:256].view(16, 16))),
    "grad .data reshape": _at(0, lambda ps, opt: _setd(ps[1].grad, lambda d: d.view(32, 16))),
    "grad .data int32 view": _at(0, lambda ps, opt: _setd(ps[1].grad, lambda d: d.view(torch.int16 if d.dtype ==
                                                                                       torch.bfloat16 else torch.int32))),
    "grad .data neg view": _at(0, lambda ps, opt: _setd(ps[1].grad, torch._neg_view)),
    "grad storage resized": _at(0, lambda ps, opt: ps[1].grad.untyped_storage().resize_(16)),
    "grad other dtype": _at(0, lambda ps, opt: setattr(ps[1], "grad", ps[1].grad.double())),
    "grad non-contiguous": _at(0, lambda ps, opt: setattr(ps[1], "grad", _g(ps[2], 3).view(32, 16).t())),
    "grad values in place": lambda ps, opt, k, mem: ps[2].grad.mul_(3.0),
    "grad aliases its param": _at(0, lambda ps, opt: setattr(ps[1], "grad", ps[1].data)),
    "grad aliases another param": _at(0, lambda ps, opt: setattr(ps[2], "grad", ps[1].data.view(-1))),
    "grad aliases a grad-less param": _at(0, lambda ps, opt: (setattr(ps[1], "grad", None),
                                                              setattr(ps[2], "grad", ps[1].data.view(-1)))),
    "grad-less param moved onto a grad": _at(0, lambda ps, opt: (setattr(ps[0], "grad", None),
                                                                 _setd(ps[0], lambda d: ps[3].grad.view(16, 16)))),
    "grad back after memory moved": _swap,
    # parameters
    "param .data t()": _at(0, lambda ps, opt: _setd(ps[0], lambda d: d.t())),
    "param .data reshape": _at(0, lambda ps, opt: _setd(ps[1], lambda d: d.view(32, 16))),
    "param .data reshape with grad": _at(0, lambda ps, opt: (_setd(ps[1], lambda d: d.view(32, 16)),
                                                             setattr(ps[1], "grad", ps[1].grad.reshape(32, 16)))),
    "param .data prefix": _at(0, lambda ps, opt: _setd(ps[1], lambda d: d.view(-1)[:256].view(16, 16))),
    "param .data dtype view": _at(0, lambda ps, opt: _setd(ps[1], lambda d: d.view(
        torch.float16 if d.dtype == torch.bfloat16 else torch.int32))),
    "param .data neg view": _at(0, lambda ps, opt: _setd(ps[1], torch._neg_view)),
    "param .data new tensor": _at(0, lambda ps, opt: _setd(ps[1], lambda d: d.clone() * 0.5)),
    "param aliases another": _at(0, lambda ps, opt: _setd(ps[2], lambda d: ps[1].data.view(-1))),
    "param written in place": lambda ps, opt, k, mem: ps[1].detach().mul_(0.5),   # bumps p._version
    "param copy_": _at(0, lambda ps, opt: ps[2].detach().copy_(_g(ps[2], 7))),
    # opt.state
    "state step replaced": _at(0, lambda ps, opt: opt.state[ps[1]].__setitem__("step", torch.tensor(10.0))),
    "state step float": _at(0, lambda ps, opt: opt.state[ps[0]].__setitem__("step", 7.0)),
    "state step .data": _at(0, lambda ps, opt: setattr(opt.state[ps[0]]["step"], "data", torch.tensor(5.0))),
    "state step in place": _at(0, lambda ps, opt: opt.state[ps[2]]["step"].fill_(20.0)),
    "state cleared": _at(0, lambda ps, opt: opt.state.clear()),
    "del state[p]": _at(0, lambda ps, opt: opt.state.__delitem__(ps[1])),
    "state[p] = {}": _at(0, lambda ps, opt: opt.state.__setitem__(ps[0], {})),
    "state[p] copied": _at(0, lambda ps, opt: opt.state.__setitem__(ps[0], dict(opt.state[ps[0]]))),
    "state replaced": _at(0, lambda ps, opt: setattr(opt, "state", defaultdict(dict))),
    "state moment replaced": _at(0, lambda ps, opt: opt.state[ps[0]].__setitem__("exp_avg", torch.zeros(16, 16))),
    "state moment .data": _at(0, lambda ps, opt: setattr(opt.state[ps[3]]["exp_avg_sq"], "data", torch.zeros(256))),
    "state moment in place": _at(0, lambda ps, opt: opt.state[ps[0]]["exp_avg"].zero_()),
}


def _scenario(kind, state, moments, dtype, tmp_path, cached=True):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    for i, p in enumerate(ps):
        p.grad = _g(p, i)   # the same gradient objects every step (values refreshed in place)
    opt = _make(ps, state, moments, tmp_path)
    for k in range(2):
        if not cached:
            _cold(opt)
        opt.step()
        for i, p in enumerate(ps):
            p.grad.copy_(_g(p, 20 + 4 * k + i))
    out, mem = [], {}
    for k in range(2):
        try:
            CHANGES[kind](ps, opt, k, mem)
        except Exception as e:   # e.g. a compressed state refuses the assignment itself
            out.append(("change", type(e).__name__, str(e)))
        before = [p.detach().clone() for p in ps]
        if not cached:
            _cold(opt)
        try:
            opt.step()
            out.append("ok")
        except Exception as e:
            out.append((type(e).__name__, str(e)))
            assert all(torch.equal(a, p.detach()) for a, p in zip(before, ps)), "a step that raised changed a parameter"
    steps = [float(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else None for p in ps]
    close = getattr(opt, "close", None)
    if close is not None:
        close()
    return out, [p.detach().clone() for p in ps], steps


def _same(a, b) -> None:
    assert a[0] == b[0]   # the same exceptions, messages included
    assert a[2] == b[2]   # step counts
    for x, y in zip(a[1], b[1]):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def _check(kind, state, moments, dtype, tmp_path):
    warm = _scenario(kind, state, moments, dtype, tmp_path / "warm", cached=True)
    cold = _scenario(kind, state, moments, dtype, tmp_path / "cold", cached=False)
    _same(warm, cold)
    return warm


@pytest.fixture
def tdir(tmp_path):
    for sub in ("warm", "cold", "host"):
        (tmp_path / sub).mkdir()
    return tmp_path


@pytest.mark.parametrize("kind", list(CHANGES))
@pytest.mark.parametrize("cfg", configs(**FAST))
def test_change_noticed_as_uncached(kind, cfg, tdir):
    _check(kind, cfg.tier, cfg.moments, torch.float32, tdir)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CHANGES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", configs(**HOST))
def test_change_noticed_as_uncached_all(kind, cfg, dtype, tdir):
    _check(kind, cfg.tier, cfg.moments, dtype, tdir)


@pytest.mark.parametrize("kind", ["new grad objects", "grad None", "grad None then back", "grad values in place",
                                  "param .data new tensor", "param written in place", "param copy_",
                                  "state step replaced", "state cleared", "del state[p]", "state moment in place",
                                  "grad .data t()", "grad .data neg view", "grad other dtype", "param .data neg view",
                                  "grad aliases its param", "grad back after memory moved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", configs(**dict(HOST, tiers=("nvme", "mmap"), moments=("fp32",))))
def test_disk_tiers_match_the_ram_tier(kind, cfg, dtype, tdir):
    engine = _check(kind, cfg.tier, cfg.moments, dtype, tdir)
    host = _scenario(kind, "ram", "fp32", dtype, tdir / "host")
    # raised or not alike (the overlap refusals of the two paths are ValueError / RuntimeError)
    assert [o == "ok" for o in engine[0]] == [o == "ok" for o in host[0]]
    for x, y in zip(engine[1], host[1]):
        assert torch.equal(x, y)
    assert engine[2] == host[2]


# ------------------------------------------------------------------ each invalidation rule, alone
def _warm(state, moments, tmp_path, dtype=torch.float32):
    ps = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]
    for i, p in enumerate(ps):
        p.grad = _g(p, i)
    opt = _make(ps, state, moments, tmp_path)
    opt.step()
    opt.step()
    return ps, opt


@pytest.mark.parametrize("cfg", configs(**HOST))
def test_gradient_given_back_is_checked_against_memory_moved_meanwhile(cfg, tmp_path):
    # At the rebuild of the write spans (param 3 moved) the record of param 0's gradient, which was
    # not checked against them, must be dropped: kept, the same tensor given back would be "unchanged"
    # and the kernel would read it while writing param 3 into the same bytes.
    ps, opt = _warm(cfg.tier, cfg.moments, tmp_path)
    g0 = ps[0].grad
    ps[0].grad = None
    ps[3].data = g0.view(-1)
    opt.step()
    ps[0].grad = g0
    with pytest.raises(offload.SharedMemoryError, match="gradient of parameter 0 of group 0 shares memory with parameter 3"):
        opt.step()


@pytest.mark.parametrize("cfg", configs(**HOST))
def test_new_plain_gradient_onto_a_parameter_is_refused(cfg, tmp_path):
    # a new gradient that passes every per-row check (plain, contiguous, right dtype and shape) is
    # checked against the write spans by its recorded (address, bytes): one in parameter 2's memory
    # (as many elements as parameter 1) is refused, and nothing is stepped
    ps, opt = _warm(cfg.tier, cfg.moments, tmp_path)
    for i in (0, 3):
        ps[i].grad = ps[i].grad.clone()   # other new gradients, fine, before and after it in the row order
    before = [p.detach().clone() for p in ps]
    ps[1].grad = ps[2].data.view(16, 32)
    with pytest.raises(offload.SharedMemoryError, match="gradient of parameter 1 of group 0 shares memory with parameter 2"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    ps[1].grad = torch.randn(16, 32)   # its own memory again
    opt.step()


@pytest.mark.parametrize("cfg", configs(**HOST))
def test_new_plain_gradient_overlapping_a_parameter_by_one_element_is_refused(cfg, tmp_path):
    # the spans compare end-exclusive: the last element of the gradient on the first of the parameter
    ps, opt = _warm(cfg.tier, cfg.moments, tmp_path)
    buf = torch.zeros(512 + 256)
    ps[2].data = buf[:512]
    opt.step()   # moved memory: the spans are built again
    ps[3].grad = buf[511:767]   # its first element is parameter 2's last
    with pytest.raises(offload.SharedMemoryError, match="gradient of parameter 3 of group 0 shares memory with parameter 2"):
        opt.step()
    ps[3].grad = buf[512:]      # right after parameter 2: accepted
    opt.step()


@pytest.mark.parametrize("cfg", configs(**HOST))
def test_gradless_parameter_moved_onto_a_cached_gradient_is_refused(cfg, tmp_path):
    ps, opt = _warm(cfg.tier, cfg.moments, tmp_path)
    ps[0].grad = None
    ps[0].data = ps[3].grad.view(16, 16)   # param 3's gradient is unchanged (cached as checked)
    with pytest.raises(ValueError, match="gradient of parameter 3 of group 0 shares memory with parameter 0"):
        opt.step()


@pytest.mark.parametrize("cfg", configs(**HOST))
def test_moved_state_tensor_is_adopted(cfg, tmp_path):
    # opt.state entries are compared by identity AND data pointer: .data = keeps the object. Every tier
    # takes the new memory's values over, as torch's AdamW uses them.
    ps, opt = _warm(cfg.tier, cfg.moments, tmp_path)
    opt.state[ps[0]]["exp_avg"].data = torch.zeros(16, 16)
    g = ps[0].grad.clone()
    opt.step()
    torch.testing.assert_close(opt.state[ps[0]]["exp_avg"], (1 - 0.9) * g)   # from the zeros put in


@pytest.mark.parametrize("cfg", configs(**HOST))
def test_refused_step_is_refused_again(cfg, tmp_path):
    # a gradient validated natively (new object) whose overlap check then failed is not trusted later
    ps, opt = _warm(cfg.tier, cfg.moments, tmp_path)
    ps[2].grad = ps[1].data.view(-1)
    for _ in range(2):
        with pytest.raises(ValueError, match="gradient of parameter 2 of group 0 shares memory with parameter 1"):
            opt.step()


@pytest.mark.parametrize("cfg", configs(**HOST))
def test_bf16_parameter_written_between_steps_is_resynced(cfg, tmp_path):
    ps, opt = _warm(cfg.tier, cfg.moments, tmp_path, dtype=torch.bfloat16)
    with torch.no_grad():
        ps[1].mul_(0.5)
    snapshot = ps[1].detach().clone()
    opt.step()
    # the kernel started from the user's values (resynced master), not from the old master
    assert (ps[1].detach().float() - snapshot.float()).abs().max() < 0.05
