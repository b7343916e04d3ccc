# test_gpu_state.py: parameters whose Adam state stays on the device (gpu_state=, schedule/split.py and
# schedule/resident.py), on the fake device. Gradients are set by hand, so each parameter's trajectory is
# its own: the parameters the CPU keeps are bitwise those of a run with every state on the host, those
# that moved are bitwise torch's AdamW over fp32 masters from the state they had; checkpoints, opt.state
# edits, writes into the weights, clipping and the tiers keep working across the split.
import math

import pytest
import torch

import offload
from offload import kernels, testing
from offload.device import FakeDevice

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SHAPES = [(40, 24), (24,), (64, 40), (40,), (33, 17)]
STEPS, AT = 6, 2   # the split after step AT
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _opt(params, opts, **kw):
    dev = FakeDevice(max_delay=0.0005, seed=1)   # (no spare memory: only the split a test makes)
    o = offload.AdamW(params, offload_device=dev, bucket_mb=0.004, **HYPER, **kw)
    opts.append(o)
    return o


def _run(dtype, opts, moved=(), steps=STEPS, mult=None, **kw):
    params = _params(dtype)
    opt = _opt(params, opts, **kw)
    for s in range(steps):
        if s == AT and moved:
            opt.synchronize()
            testing.keep_on_device(opt, [params[i] for i in moved])
        _grads(params, s)
        opt.step(grad_multiplier=mult)
    opt.synchronize()
    return params, opt


def _torch_from(sd_entry, p0, steps, dtype, mult):
    """torch's AdamW (foreach) over an fp32 master from ``sd_entry`` (state after step AT)."""
    master = (sd_entry["master_param"] if "master_param" in sd_entry else p0).detach().float().clone()
    t = torch.optim.AdamW([master], foreach=True, **HYPER)
    t.state[master] = {k: v.clone() for k, v in sd_entry.items() if k != "master_param"}
    return master, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("schedule", [{}, dict(max_grad_norm=5.0), dict(overlap=False)])
def test_moved_parameters_are_torchs_adamw_the_others_unchanged(dtype, schedule, opts):
    moved = (0, 1)
    mult = 0.5 if schedule.get("overlap") is False else None
    host, _ = _run(dtype, opts, gpu_state=0, mult=mult, **schedule)
    split, opt = _run(dtype, opts, moved=moved, mult=mult, **schedule)
    st = opt.last_step_stats(wait=True)
    assert st["gpu_state_params"] == len(moved) and st["gpu_state_bytes"] > 0
    for i in range(len(SHAPES)):
        if i not in moved:
            assert torch.equal(split[i].detach(), host[i].detach()), i
    # the moved ones: torch's AdamW from the state the host run had after step AT
    before, o2 = _run(dtype, opts, gpu_state=0, steps=AT, mult=mult, **schedule)
    sd = o2.state_dict()["state"]
    for i in moved:
        master, t = _torch_from(sd[i], before[i], STEPS - AT, dtype, mult)
        for s in range(AT, STEPS):
            g = torch.Generator().manual_seed(100 + s)
            gs = [torch.randn(sh, generator=g).to(dtype) for sh in SHAPES]
            scale = 1.0 if mult is None else mult
            if "max_grad_norm" in schedule:   # the global norm of every gradient, as offload clips
                coef = schedule["max_grad_norm"] / (math.sqrt(kernels.grad_sumsq(gs)) * scale + 1e-6)
                scale *= min(1.0, coef)
            master.grad = gs[i].float() * scale if scale != 1.0 else gs[i].float()
            t.step()
        assert torch.equal(split[i].detach(), master.to(dtype)), i
        got = opt.state_dict()["state"][i]
        assert set(got) == set(sd[i]) and torch.equal(got["exp_avg"], t.state[master]["exp_avg"]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoints_resume_bitwise_across_the_split(dtype, opts, tmp_path):
    moved = (0, 3)
    whole, wopt = _run(dtype, opts, moved=moved)
    params, opt = _run(dtype, opts, moved=moved, steps=4)
    weights = [p.detach().clone() for p in params]
    offload.save(opt, tmp_path / "ckpt")
    sd = opt.state_dict()
    for how in ("save", "state_dict"):
        ps = _params(dtype)
        with torch.no_grad():
            for p, w in zip(ps, weights):
                p.copy_(w)
        o = _opt(ps, opts)
        o.synchronize()
        testing.keep_on_device(o, [ps[i] for i in moved])
        if how == "save":
            offload.load(o, tmp_path / "ckpt")
        else:
            o.load_state_dict(sd)
        for s in range(4, STEPS):
            _grads(ps, s)
            o.step()
        o.synchronize()
        for i, (a, b) in enumerate(zip(ps, whole)):
            assert torch.equal(a.detach(), b.detach()), (how, i)
        got, want = o.state_dict()["state"], wopt.state_dict()["state"]
        for i in range(len(SHAPES)):
            assert all(torch.equal(got[i][k], want[i][k]) for k in want[i]), (how, i)
    # and into an optimizer that keeps every state on the host: the same layout, torch's numbers
    ps = _params(dtype)
    host = _opt(ps, opts, gpu_state=0)
    host.load_state_dict(sd)
    assert {k: sorted(v) for k, v in host.state_dict()["state"].items()} == \
        {k: sorted(v) for k, v in sd["state"].items()}


def test_opt_state_of_a_moved_parameter_is_torchs(opts):
    """In-place edits are what the next step reads; a deleted entry starts afresh (its master from the
    weights); a bf16 weight written through .data is taken into the master."""
    params, opt = _run(torch.bfloat16, opts, moved=(0,), steps=3)
    p = params[0]
    st = opt.state[p]
    st["exp_avg"].zero_()
    before = st["exp_avg_sq"].clone()
    _grads(params, 3)
    g = p.grad.float()
    opt.step()
    opt.synchronize()
    assert torch.equal(opt.state[p]["exp_avg"], (1 - 0.9) * g)   # from the zeros put in
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], 0.99 * before + (1 - 0.99) * g * g)
    del opt.state[p]
    with torch.no_grad():
        p.data[0, :3] = torch.tensor([1.0, 2.0, 3.0])   # a write through .data: no version counter
    w = p.detach().float().clone()
    _grads(params, 4)
    opt.step()
    opt.synchronize()
    assert float(opt.state[p]["step"]) == 1   # afresh
    master, t = _torch_from({}, w, 1, torch.bfloat16, None)
    master.grad = p.grad.float()
    t.step()
    assert torch.equal(opt.state[p]["master_param"], master)


def test_nvme_state_with_an_explicit_budget_and_auto_off(opts, tmp_path):
    params, opt = _run(torch.float32, opts, moved=(1,), storage="nvme", nvme_dir=tmp_path, gpu_state="64MiB")
    host, _ = _run(torch.float32, opts, storage="nvme", nvme_dir=tmp_path, gpu_state=0)
    for i in (0, 2, 3, 4):
        assert torch.equal(params[i].detach(), host[i].detach()), i
    auto = _opt(_params(torch.float32), opts, storage="nvme", nvme_dir=tmp_path)
    with pytest.raises(RuntimeError, match="no split"):   # "auto" keeps NVMe state where it is
        testing.keep_on_device(auto, [])


def test_a_model_trains_across_the_split_in_every_schedule(opts):
    """A real backward (buckets stepped during it by default): the split after two steps; the run stays
    within rounding of the one with every state on the host."""
    torch.manual_seed(0)
    losses = {}
    for name, kw in (("host", dict(gpu_state=0)), ("split", {}), ("split-clip", dict(max_grad_norm=1.0)),
                     ("host-clip", dict(gpu_state=0, max_grad_norm=1.0))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).bfloat16()
        opt = _opt(model.parameters(), opts, **kw)
        data = torch.Generator().manual_seed(5)
        out = []
        for s in range(8):
            if s == AT and name.startswith("split"):
                opt.synchronize()
                testing.keep_on_device(opt, list(model[0].parameters()))
            x = torch.randn(16, 32, generator=data).bfloat16()
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(float(loss.detach()))
        opt.synchronize()
        losses[name] = out
        if name.startswith("split"):
            assert opt.last_step_stats()["gpu_state_params"] == 2
    assert losses["split"][:AT + 1] == losses["host"][:AT + 1]
    torch.testing.assert_close(losses["split"], losses["host"], rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(losses["split-clip"], losses["host-clip"], rtol=2e-2, atol=1e-4)


def test_the_option_is_checked(opts):
    ps = _params(torch.float32)
    for bad in ("lots", -1, True, 1.5j):
        with pytest.raises(ValueError, match="gpu_state must be 'auto', a size"):
            _opt(ps, opts, gpu_state=bad)
    with pytest.raises(ValueError, match="gpu_state cannot be combined with delay_updates=1"):
        _opt(ps, opts, gpu_state="1GiB", delay_updates=1)
    o = _opt(ps, opts, delay_updates=1)   # "auto" turns itself off with the delayed update
    with pytest.raises(RuntimeError, match="no split"):
        testing.keep_on_device(o, [])
    with pytest.raises(TypeError, match="only apply to GPU offload"):
        offload.AdamW(ps, gpu_state="1GiB")


def _with_torch(opts, moved: int, change):
    """Params[moved] kept on the device from step AT, beside torch's AdamW on the same params;
    ``change(opt, topt, params, ref)`` before step AT + 1: both runs' parameters at the end."""
    params, ref = _params(torch.float32), _params(torch.float32)
    opt = _opt(params, opts)
    topt = torch.optim.AdamW(ref, foreach=False, **HYPER)
    for s in range(STEPS):
        if s == AT:
            opt.synchronize()
            testing.keep_on_device(opt, [params[moved]])
        if s == AT + 1:
            change(opt, topt, params, ref)
        _grads(params, s)
        _grads(ref, s)
        opt.step()
        topt.step()
    opt.synchronize()
    return params, ref


@pytest.mark.parametrize("replace", ["data", "data of another shape"])
def test_a_moved_parameter_whose_data_is_replaced(replace, opts):
    # torch steps the tensor p.data holds now, with p's state; an fp32 parameter kept on the
    # device must not go on stepping the storage it had (its weights would stop training)
    def change(opt, topt, params, ref):
        opt.synchronize()
        for p in (params[0], ref[0]):
            p.data = p.data.clone() * 0.5 if replace == "data" else p.data[:1].clone()
    if replace != "data":
        with pytest.raises(RuntimeError, match="parameter 0 of group 0 .*changed size"):
            _with_torch(opts, 0, change)
        return
    for p, r in zip(*_with_torch(opts, 0, change)):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)


def test_a_moved_parameter_put_in_a_group_of_its_own(opts):
    # a parameter kept on the device, moved to a new param group with its own lr (a per-layer
    # lr): stepped with that group's hyperparameters and its state, as torch's AdamW does
    def change(opt, topt, params, ref):
        for o in (opt, topt):
            o.add_param_group({"params": [o.param_groups[0]["params"].pop()], "lr": 3e-3})
    for p, r in zip(*_with_torch(opts, len(SHAPES) - 1, change)):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)
