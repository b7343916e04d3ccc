"""test_step_plan_fuzz.py: random sequences of what a user does between steps (new or edited
gradients, a missing gradient, hyperparameters, edits and replacements in ``opt.state`` and of
``p.data``, a state_dict round trip), run three ways: offload.AdamW as it runs (its steps planned
where nothing changed, offload/engine/fastpath.py), offload.AdamW with every step run in full, and
torch.optim.AdamW. The first two must agree bitwise (outcomes, parameters, state); fp32 runs must
agree with torch to its rounding (where no step count was made invalid: offload refuses those by
name, torch steps with them). Seeded: a failure names the actions; OFFLOAD_FUZZ_SEEDS=N runs N
seeds per case instead of a few.
"""
from __future__ import annotations

import os
import random
import tempfile

import pytest
import torch

import offload
from offload import testing
from conftest import Config, configs

SHAPES = [(12, 10), (257,), (5,)]
SEEDS = int(os.environ.get("OFFLOAD_FUZZ_SEEDS", "0"))


def _grad(p, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype)


def _synchronize(opt):   # device parameters: copies and uploads land before a write (docs/gpu.md)
    if hasattr(opt, "synchronize"):
        opt.synchronize()


def _new_grads(ps, opt, r):
    for i, p in enumerate(ps):
        p.grad = _grad(p, r + i)


def _edit_grad(ps, opt, r):
    _synchronize(opt)   # device parameters: a write into a gradient after step() (docs/gpu.md)
    g = ps[r % len(ps)].grad
    if g is not None:
        g.mul_(0.5)


def _no_grad(ps, opt, r):   # a parameter backward did not reach this time
    ps[r % len(ps)].grad = None


def _lr(ps, opt, r):
    opt.param_groups[0]["lr"] = 1e-2 / (1 + r % 5)


def _betas(ps, opt, r):
    opt.param_groups[0]["betas"] = (0.8 + 0.01 * (r % 5), 0.99)


def _weight_decay(ps, opt, r):
    opt.param_groups[0]["weight_decay"] = 0.1 * (r % 3)


def _maximize(ps, opt, r):
    opt.param_groups[0]["maximize"] = not opt.param_groups[0]["maximize"]


def _edit_moment(ps, opt, r):
    st = opt.state.get(ps[r % len(ps)])
    if st:
        st["exp_avg"].mul_(0.9)


def _replace_moment(ps, opt, r):
    st = opt.state.get(ps[r % len(ps)])
    if st:
        st["exp_avg_sq"] = st["exp_avg_sq"].clone() * 1.5


def _write_step(ps, opt, r):
    st = opt.state.get(ps[r % len(ps)])
    if st:
        st["step"].fill_(float(3 + r % 4))


def _bad_step(ps, opt, r):   # refused by name until a valid count is written (_write_step)
    st = opt.state.get(ps[r % len(ps)])
    if st:
        st["step"].fill_(float("nan") if r % 2 else -2.0)


def _edit_param(ps, opt, r):
    _synchronize(opt)
    with torch.no_grad():
        ps[r % len(ps)].add_(0.01)


def _replace_param(ps, opt, r):
    _synchronize(opt)
    p = ps[r % len(ps)]
    p.data = p.data.clone() * 0.5


def _del_state(ps, opt, r):   # that parameter starts afresh, as in torch
    opt.state.pop(ps[r % len(ps)], None)


def _zero_grad_keep(ps, opt, r):   # gradients zeroed in place (waits for the last step)
    opt.zero_grad(set_to_none=False)


def _add_group(ps, opt, r):   # a new parameter in a group of its own (a layer unfrozen, say)
    gen = torch.Generator().manual_seed(r)
    q = torch.nn.Parameter(torch.randn(7 + r % 5, generator=gen).to(ps[0].dtype))
    q.grad = _grad(q, r)
    opt.add_param_group({"params": [q], "lr": 3e-3})
    ps.append(q)


def _move_param(ps, opt, r):   # the last parameter of group 0 to a group of its own lr
    if len(opt.param_groups[0]["params"]) > 1:
        q = opt.param_groups[0]["params"].pop()
        opt.add_param_group({"params": [q], "lr": 1e-3 * (1 + r % 3)})


def _keep_on_device(ps, opt, r):   # its state kept and stepped on the device (gpu_state=)
    if getattr(opt, "gpu_offload", False) and r % 2:
        opt.synchronize()
        try:
            testing.keep_on_device(opt, [ps[r % len(ps)]])
        except RuntimeError as e:   # state in files: the split is off
            assert "no split" in str(e)


def _checkpoint(ps, opt, r):   # offload.save then offload.load, into the same optimizer
    with tempfile.TemporaryDirectory() as d:
        offload.save(opt, os.path.join(d, "ckpt"))
        offload.load(opt, os.path.join(d, "ckpt"))


def _round_trip(ps, opt, r):
    opt.load_state_dict(opt.state_dict())


ACTIONS = [_new_grads, _new_grads, _new_grads, _edit_grad, _no_grad, _lr, _betas, _weight_decay,
           _maximize, _edit_moment, _replace_moment, _write_step, _edit_param, _replace_param,
           _round_trip, _checkpoint, _del_state, _zero_grad_keep, _add_group, _move_param,
           _keep_on_device, _bad_step]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:   # bitwise (a NaN step count equals itself)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _near(a: torch.Tensor, b: torch.Tensor, tol: float, what) -> None:
    """``a`` within ``tol`` of ``b``'s largest magnitude everywhere (two kernels' rounding)."""
    a, b = a.detach().cpu().float(), b.detach().float()
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert a.shape == b.shape and err <= tol * scale + 1e-30, f"{what()}: {err} > {tol} * {scale}"


PARAM_TOL, STATE_TOL = 5e-7, 5e-6   # (measured here: 7e-8 and 6e-7 at most over 60 sequences)


def _script(seed: int, steps: int) -> list:
    rnd = random.Random(seed)
    return [[(rnd.choice(ACTIONS), rnd.randrange(1000)) for _ in range(rnd.randrange(3))]
            for _ in range(steps)]


def _valid_script(seed: int, steps: int) -> list:   # no step count made invalid
    return [[(a, r) for a, r in acts if a is not _bad_step] for acts in _script(seed, steps)]


def _run(make, script, dtype, full: bool, before_step=None, step=None):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    _new_grads(ps, None, 0)
    opt = make(ps)
    out = []
    for acts in script:
        for act, r in acts:
            try:
                act(ps, opt, r)
            except ValueError as e:   # compressed moments are not replaced one by one
                out.append((act.__name__, str(e)))
        if full:
            testing.drop_row_caches(opt)
            opt.param_groups[:] = [dict(g) for g in opt.param_groups]
        try:
            if before_step is not None:
                before_step(ps, opt)
            (opt.step if step is None else lambda: step(opt))()
            out.append("ok")
        except ValueError as e:   # (a step count refused: _bad_step)
            out.append((type(e).__name__, str(e)))
    _synchronize(opt)   # (the fake device's uploads land late: read after them, as CUDA orders)
    state = [{k: v.clone() for k, v in opt.state[p].items()} if p in opt.state else {}
             for p in ps]
    return out, [p.detach().clone() for p in ps], state


@pytest.mark.parametrize("moments", ["fp32", "8bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", range(SEEDS or 8))
def test_random_user_actions_planned_equal_full_and_torch(seed, dtype, moments):
    script = _script(seed * 31 + 7, steps=10)
    names = [[a.__name__ for a, _ in acts] for acts in script]

    def ours(ps):
        return offload.AdamW(ps, lr=1e-2, weight_decay=0.0, threads=1, moments=moments,
                             moments_min_size=100)
    planned = _run(ours, script, dtype, full=False)
    full = _run(ours, script, dtype, full=True)
    assert planned[0] == full[0], names
    bad = any(a is _bad_step for acts in script for a, _ in acts)
    assert bad or moments != "fp32" or planned[0] == ["ok"] * len(script), names
    for a, b in zip(planned[1], full[1]):
        assert _same(a, b), names
    for sa, sb in zip(planned[2], full[2]):
        assert sa.keys() == sb.keys(), names
        assert all(_same(sa[k], sb[k]) for k in sa), names
    if dtype is torch.float32 and moments == "fp32" and not bad:
        ref = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0, foreach=False),
                   script, dtype, full=False)
        for a, b in zip(planned[1], ref[1]):
            _near(a, b, PARAM_TOL, lambda: names)
        for sa, sb in zip(planned[2], ref[2]):
            assert sa.keys() == sb.keys(), names
            for k in sa:
                _near(sa[k], sb[k], STATE_TOL, lambda: (names, k))


VARIANTS = {   # offload's optimizer and options, torch's class and options
    "adamw": (dict(weight_decay=0.0), torch.optim.AdamW),
    "amsgrad": (dict(weight_decay=0.01, amsgrad=True), torch.optim.AdamW),
    "adam-l2": (dict(weight_decay=0.01), torch.optim.Adam),
}


@pytest.mark.parametrize("cfg", configs(moments=("fp32",), schedules=("eager", "deferred")),
                         ids=lambda c: c.id)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("seed", range(SEEDS or 2))
def test_random_user_actions_every_tier_and_side_equal_torch(seed, variant, cfg, make_opt,
                                                             tmp_path):
    # the same sequences where no step is planned: state in files, parameters on a device
    script = _valid_script(seed * 17 + 3, 8)
    names = [[a.__name__ for a, _ in acts] for acts in script]
    kw, cls = VARIANTS[variant]
    made = []

    def ours_of(ps):   # (offload.Adam is not make_opt's: closed here)
        if cls is torch.optim.AdamW:
            return make_opt(cfg, ps, lr=1e-2, **kw)
        made.append(offload.Adam(ps, **cfg.kwargs(tmp_path, lr=1e-2, **kw)))
        return made[-1]
    ours = _run(ours_of, script, torch.float32, full=False)
    for o in made:
        o.close()
    ref = _run(lambda ps: cls(ps, lr=1e-2, foreach=False, **kw), script, torch.float32,
               full=False)
    assert ours[0] == ref[0] == ["ok"] * len(script), names
    for a, b in zip(ours[1], ref[1]):
        _near(a, b, PARAM_TOL, lambda: names)
    for sa, sb in zip(ours[2], ref[2]):
        assert sa.keys() - {"master_param"} == sb.keys(), names
        for k in sb:
            _near(sa[k].cpu(), sb[k], STATE_TOL, lambda: (names, k))


class _ClippedAdamW(torch.optim.AdamW):
    """torch's clip_grad_norm_ then AdamW, the gradients given back unclipped after the step: the
    rule of offload's clipping, a coefficient the step applies (optim/clipping.py)."""

    def __init__(self, params, norm, **kw):
        super().__init__(params, **kw)
        self.norm = norm

    def step(self):
        ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        kept = [p.grad.clone() for p in ps]
        torch.nn.utils.clip_grad_norm_(ps, self.norm)
        super().step()
        for p, g in zip(ps, kept):
            p.grad.copy_(g)


# clipping needs every gradient first (refused while stepping during backward); max_grad_norm= is
# an option of device parameters
CLIPPED = [pytest.param(how, c, id=f"{how}-{c.id}")
           for c in (row.values[0] for row in configs(moments=("fp32",), schedules=("deferred",)))
           for how in ("clip_grad_norm_", "max_grad_norm") if c.device or how == "clip_grad_norm_"]


@pytest.mark.parametrize("how,cfg", CLIPPED)
@pytest.mark.parametrize("seed", range(SEEDS or 2))
def test_random_user_actions_with_clipping_equal_torch(seed, how, cfg, make_opt):
    # clipped steps (the norm over every gradient, a coefficient applied in the step) against
    # torch.nn.utils.clip_grad_norm_ then torch.optim.AdamW
    norm = 0.5 + 0.25 * seed % 3
    script = _valid_script(seed * 13 + 5, 8)
    names = [[a.__name__ for a, _ in acts] for acts in script]
    kw = dict(max_grad_norm=norm) if how == "max_grad_norm" else {}
    ours = _run(lambda ps: make_opt(cfg, ps, lr=1e-2, weight_decay=0.0, **kw), script,
                torch.float32, full=False,
                before_step=None if kw else lambda ps, opt: opt.clip_grad_norm_(norm))
    ref = _run(lambda ps: _ClippedAdamW(ps, norm, lr=1e-2, weight_decay=0.0, foreach=False),
               script, torch.float32, full=False)
    assert ours[0] == ref[0] == ["ok"] * len(script), names
    for a, b in zip(ours[1], ref[1]):
        _near(a, b, PARAM_TOL, lambda: names)
    for sa, sb in zip(ours[2], ref[2]):
        for k in sb:
            _near(sa[k].cpu(), sb[k], STATE_TOL, lambda: (names, k))


@pytest.mark.parametrize("cfg", configs(sides=("cpu", "fake"), schedules=("eager", "deferred")),
                         ids=lambda c: c.id)
@pytest.mark.parametrize("seed", range(SEEDS or 2))
def test_random_user_actions_device_equal_host_bf16(seed, cfg, make_opt):
    # bf16 parameters, every moment format: parameters on a device step as host parameters do.
    # (Last, a step of every parameter: a host parameter written since its last step takes the
    # write into its master at its next step, a device parameter at the next step of any.)
    # (no state kept on the device: torch's fused AdamW steps it there, to rounding)
    script = [[(a, r) for a, r in acts if a is not _keep_on_device]
              for acts in _valid_script(seed * 7 + 1, 8)] + [[(_new_grads, 999)]]
    names = [[a.__name__ for a, _ in acts] for acts in script]
    host = Config("host", "ram", cfg.moments)
    runs = [_run(lambda ps, c=c: make_opt(c, ps, lr=1e-2), script, torch.bfloat16, full=False)
            for c in (host, cfg)]
    assert runs[0][0] == runs[1][0], names
    for a, b in zip(runs[0][1], runs[1][1]):
        assert _same(a, b), names
    for sa, sb in zip(runs[0][2], runs[1][2]):
        assert sa.keys() == sb.keys(), names
        for k in sa:
            assert _same(sa[k].cpu(), sb[k].cpu()), (names, k)


def _inf_grad(ps, opt, r):   # an overflow: the scaler skips the step
    _synchronize(opt)   # (a write into a gradient)
    g = ps[r % len(ps)].grad
    if g is not None:
        g.view(-1)[r % g.numel()] = float("inf")


def _scaled(scaler):
    def step(opt):
        scaler.scale(torch.ones(()))   # (what sets the scale up: a loss in training)
        scaler.step(opt)
        scaler.update()
    return step


@pytest.mark.parametrize("cfg", configs(moments=("fp32",), schedules=("deferred",)),
                         ids=lambda c: c.id)
@pytest.mark.parametrize("seed", range(SEEDS or 2))
def test_random_user_actions_with_a_grad_scaler_equal_torch(seed, cfg, make_opt):
    # torch.amp.GradScaler: its gradients unscaled, a step with an inf gradient skipped, the
    # scale halved and grown, against torch's AdamW under the same scaler. Each step has new
    # gradients, as from a backward: with device parameters the step leaves them scaled where
    # torch divides them in place (docs/gpu.md), so a second step over the same ones differs.
    rnd = random.Random(seed)
    script = [[(_new_grads, 100 * k)] + acts
              + ([(_inf_grad, rnd.randrange(1000))] if rnd.random() < 0.3 else [])
              for k, acts in enumerate(_valid_script(seed * 11 + 2, 8))]
    names = [[a.__name__ for a, _ in acts] for acts in script]
    kw = dict(check_overflow=True) if cfg.device else {}
    runs = [_run(make, script, torch.float32, full=False,
                 step=_scaled(torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2)))
            for make in (lambda ps: make_opt(cfg, ps, lr=1e-2, weight_decay=0.0, **kw),
                         lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0,
                                                      foreach=False))]
    assert runs[0][0] == runs[1][0] == ["ok"] * len(script), names
    for a, b in zip(runs[0][1], runs[1][1]):
        _near(a, b, PARAM_TOL, lambda: names)
    for sa, sb in zip(runs[0][2], runs[1][2]):
        for k in sb:
            _near(sa[k].cpu(), sb[k], STATE_TOL, lambda: (names, k))


@pytest.mark.parametrize("cfg", configs(sides=("fake",), tiers=("ram",), moments=("fp32",),
                                        schedules=("deferred",)), ids=lambda c: c.id)
def test_grad_scaler_leaves_device_gradients_scaled(cfg, make_opt):
    # what docs/gpu.md says: the unscale is folded into the kernel, p.grad keeps the scaled values
    # (torch's AdamW divides them in place); scaler.unscale_ before the step gives torch's
    p = torch.nn.Parameter(torch.randn(20))
    opt = make_opt(cfg, [p], lr=1e-2, check_overflow=True)
    for unscale_first in (False, True):
        scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
        scaler.scale(torch.ones(()))
        p.grad = torch.full((20,), 16.0)
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        opt.synchronize()
        assert torch.equal(p.grad, torch.full((20,), 1.0 if unscale_first else 16.0))
