"""test_moments_state.py: the state of compressed Adam moments (issue 9, moments="bf16"|"8bit"):
state_dict interchange with torch.optim.AdamW, loads that convert between formats, offload.save/load
resume bitwise (also into fp32 RAM state), values the encoder cannot write refused, and held moment
tensors that behave like torch's live state (host and device paths).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import offload
from offload import testing
from moments_util import FMTS, N, SMALL, _run


@pytest.mark.parametrize("fmt", FMTS)
def test_state_dict_through_torch_adamw(fmt):
    torch.manual_seed(3)
    p = torch.randn(N)
    opt = offload.AdamW([p], lr=1e-3, moments=fmt)
    _run(opt, [p], 3)
    sd = opt.state_dict()
    st = sd["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["exp_avg"].dtype == torch.float32
    q = p.clone()
    t = torch.optim.AdamW([q], lr=1e-3)
    t.load_state_dict(sd)                                   # loads into torch
    assert torch.equal(t.state[q]["exp_avg"], st["exp_avg"])
    # back into an offload optimizer of the same format: re-quantized to (nearly) the state it came
    # from: bf16 exactly; 8bit: a decoded scale 127 * (s / 127) may be 1 ulp off s (fp32 rounding),
    # so the codes agree and the scales are within 1 ulp. Bitwise resume is offload.save's job.
    r = p.clone()
    back = offload.AdamW([r], lr=1e-3, moments=fmt)
    back.load_state_dict(t.state_dict())
    a, b = testing.raw_state(opt, p), testing.raw_state(back, r)
    for k in a:
        if a[k].dtype == torch.float32 and "scale" in k:
            assert torch.allclose(a[k], b[k], rtol=2 ** -22, atol=0), k
        else:
            assert torch.equal(a[k], b[k]), k
    _run(opt, [p], 2, seed=10)
    _run(back, [r], 2, seed=10)
    assert torch.allclose(p, r, rtol=0, atol=1e-6) if fmt == "8bit" else torch.equal(p, r)
    # a torch state (fp32 moments) into compressed moments: quantized, close to torch's moments
    _run(t, [q], 2, seed=10)
    c = offload.AdamW([q.clone()], lr=1e-3, moments=fmt)
    c.load_state_dict(t.state_dict())
    for k in ("exp_avg", "exp_avg_sq"):
        want = t.state[q][k]
        assert ((c.state[c.param_groups[0]["params"][0]][k] - want).norm() / want.norm()) < 0.05


@pytest.mark.parametrize("src,dst", [("8bit", "bf16"), ("bf16", "8bit"), ("8bit", "fp32"), ("fp32", "8bit")])
def test_load_state_dict_converts_formats(src, dst, tmp_path):
    """A compressed state (offload.save form) into an optimizer of another format: converted."""
    torch.manual_seed(5)
    p = torch.randn(N)
    opt = offload.AdamW([p], lr=1e-3, moments=src)
    _run(opt, [p], 3)
    dec = {k: opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")}
    kw = dict(storage="mmap", nvme_dir=str(tmp_path)) if dst == "fp32" else {}
    other = offload.AdamW([p.clone()], lr=1e-3, moments=dst, **kw)
    d = tmp_path / "ck"
    offload.save(opt, d)
    offload.load(other, d)
    q = other.param_groups[0]["params"][0]
    for k, want in dec.items():
        got = other.state[q][k]
        assert ((got - want).norm() / want.norm()) < (0.02 if dst != "8bit" else 0.05)
        if dst == "fp32":
            assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- save/load
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("state", ["ram", "nvme", "mmap"])
def test_save_load_resume_bitwise(fmt, state, tmp_path):
    torch.manual_seed(6)
    (tmp_path / "s").mkdir()
    (tmp_path / "s2").mkdir()
    kw = dict(storage=state, nvme_dir=str(tmp_path / "s")) if state != "ram" else {}
    ps = [torch.randn(N, dtype=torch.bfloat16), torch.randn(SMALL)]
    opt = offload.AdamW(ps, lr=1e-2, moments=fmt, **kw)
    _run(opt, ps, 2)
    offload.save(opt, tmp_path / "ck")
    idx = next(f for f in os.listdir(tmp_path / "ck") if f.startswith("rank") and f.endswith(".json"))
    keys = {t["key"]: t["dtype"] for t in json.load(open(tmp_path / "ck" / idx))["tensors"] if t["param"] == 0}
    assert f"exp_avg.{fmt}" in keys and "exp_avg" not in keys          # stored compressed
    if fmt == "8bit":
        assert keys["exp_avg.8bit"] == "I8" and "exp_avg_scale.8bit" in keys
    qs = [p.clone() for p in ps]
    kw2 = dict(storage=state, nvme_dir=str(tmp_path / "s2")) if state != "ram" else {}
    opt2 = offload.AdamW(qs, lr=1e-2, moments=fmt, **kw2)
    offload.load(opt2, tmp_path / "ck")
    _run(opt, ps, 2, seed=20)
    _run(opt2, qs, 2, seed=20)
    assert all(torch.equal(a, b) for a, b in zip(ps, qs))


def test_compressed_checkpoint_into_fp32_ram_is_decoded(tmp_path):
    # loaded by fp32 moments (any tier): decoded, exactly what the 8-bit optimizer's opt.state shows
    p = torch.randn(N)
    opt = offload.AdamW([p], moments="8bit")
    _run(opt, [p], 1)
    offload.save(opt, tmp_path)
    sd = {"state": {0: dict(testing.raw_state(opt, p), step=torch.tensor(1.0))},
          "param_groups": opt.state_dict()["param_groups"]}
    (q, r), want = (p.clone(), p.clone()), {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    fp32, raw = offload.AdamW([q]), offload.AdamW([r])
    offload.load(fp32, tmp_path)
    raw.load_state_dict(sd)
    assert all(torch.equal(o.state[t][k], v) for o, t in ((fp32, q), (raw, r)) for k, v in want.items())


@pytest.mark.parametrize("fmt,key,bad,match", [
    ("8bit", "exp_avg_scale.8bit", -1.0, "is no block scale"),
    ("8bit", "exp_avg_sq_scale.8bit", float("inf"), "is no block scale"),
    ("8bit", "exp_avg_scale.8bit", 3.0, "is no block scale"),      # above shr1(FLT_MAX) ~ 1.5
    ("8bit", "exp_avg_scale.8bit", float("-nan"), "is no block scale"),
    ("8bit", "exp_avg.8bit", -128, "outside the codes"),
    ("bf16", "exp_avg_sq.bf16", -2.0, "is negative"),
])
def test_load_refuses_compressed_values_the_encoder_cannot_write(fmt, key, bad, match):
    """A hand-made or damaged compressed state would decode to moments no training produced (a
    negative scale flips a block's m): refused by name, in every format it could load into."""
    torch.manual_seed(8)
    p = torch.randn(N)
    opt = offload.AdamW([p], lr=1e-3, moments=fmt)
    _run(opt, [p], 2)
    raw = {k: v.clone() for k, v in testing.raw_state(opt, p).items()}
    sd = {"state": {0: dict(raw, step=torch.tensor(2.0))}, "param_groups": opt.state_dict()["param_groups"]}
    good = {k: v.clone() for k, v in raw.items()}
    raw[key].reshape(-1)[1] = bad
    for dst in (fmt, "8bit" if fmt == "bf16" else "bf16"):
        with pytest.raises(ValueError, match=match):
            offload.AdamW([p.clone()], lr=1e-3, moments=dst).load_state_dict(sd)
    sd["state"][0].update(good)                    # the untouched state still loads
    offload.AdamW([p.clone()], lr=1e-3, moments=fmt).load_state_dict(sd)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("state", ["ram", "nvme"])
def test_held_moment_tensors_behave_like_torchs_live_state(fmt, state, tmp_path):
    """opt.state[p]['exp_avg'] with compressed moments is a decoded copy; while the caller holds it,
    an in-place write is adopted at the next step (as torch's live state tensors) and after each
    step it holds the new moments. Checked against the same writes into a kernel-level state."""
    torch.manual_seed(11)
    kw = dict(storage=state, nvme_dir=str(tmp_path)) if state != "ram" else {}
    ps = [torch.randn(N)]
    opt = offload.AdamW(ps, lr=1e-2, moments=fmt, **kw)
    twin = offload.AdamW([ps[0].clone()], lr=1e-2, moments=fmt)
    q = twin.param_groups[0]["params"][0]
    _run(opt, ps, 2)
    _run(twin, [q], 2)
    m = opt.state[ps[0]]["exp_avg"]                      # held across steps
    m[:300] = 0.0                                        # in place: adopted at the next step
    v = opt.state[ps[0]]["exp_avg_sq"]
    v.numpy()[-5:] *= 4.0                                # a write no version counter sees
    sd = twin.state_dict()                               # the twin gets the same moments through load_state_dict
    sd["state"][0]["exp_avg"][:300] = 0.0
    sd["state"][0]["exp_avg_sq"].view(-1)[-5:] *= 4.0
    twin.load_state_dict(sd)
    _run(opt, ps, 1, seed=5)
    _run(twin, [q], 1, seed=5)
    assert torch.equal(ps[0], q)                         # the written moments took part in the step
    for key, held in (("exp_avg", m), ("exp_avg_sq", v)):
        assert torch.equal(held, opt.state[ps[0]][key])  # refreshed after the step
        assert torch.equal(held, twin.state[q][key])
    opt.state[ps[0]]["exp_avg"].zero_()                  # a temporary: dropped at once, nothing to adopt
    _run(opt, ps, 1, seed=6)
    _run(twin, [q], 1, seed=6)
    assert torch.equal(ps[0], q)
    a, b = opt.state[ps[0]]["exp_avg"], opt.state[ps[0]]["exp_avg"]
    a.fill_(1.0)
    b.fill_(2.0)
    with pytest.raises(ValueError, match="written in place with different values"):
        _run(opt, ps, 1, seed=7)
    del a, b
    del opt.state[ps[0]]                                 # restarts the state: what was held is not it any more
    _run(opt, ps, 1, seed=8)
    assert not torch.equal(m, opt.state[ps[0]]["exp_avg"]) and int(opt.state[ps[0]]["step"]) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ("after_backward", "during_backward"))
def test_held_moment_tensors_on_the_device_path(schedule):
    """The same with device parameters (FakeDevice) in both step schedules: the write is adopted before the
    buckets are stepped, the held tensor is refreshed when the step's last bucket is done."""
    from offload.device import FakeDevice
    from test_matrix import train_bf16_mlp

    def make():
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(70, 90), torch.nn.Linear(90, 50)).to(torch.bfloat16)
        opt = offload.AdamW(model.parameters(), lr=1e-2, moments="8bit", moments_min_size=1024,
                            offload_device=FakeDevice(max_delay=0.001), bucket_mb=0.01,
                            step_during_backward=schedule == "during_backward")
        return model, opt

    train = train_bf16_mlp
    (a, opt_a), (b, opt_b) = make(), make()
    train(a, opt_a, 2, 1)
    train(b, opt_b, 2, 1)
    w = a[0].weight
    held = opt_a.state[w]["exp_avg"]
    held[:7] = 0.0
    sd = opt_b.state_dict()
    sd["state"][0]["exp_avg"][:7] = 0.0
    opt_b.load_state_dict(sd)
    train(a, opt_a, 2, 2)
    train(b, opt_b, 2, 2)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    assert torch.equal(held, opt_a.state[w]["exp_avg"]) and torch.equal(held, opt_b.state[b[0].weight]["exp_avg"])
    # written right after step() returns, with no synchronize(): the refresh of the step must not land on
    # top of the write (step() waits for its last bucket while a moment is held)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 70, generator=g).to(torch.bfloat16)
    for model, opt in ((a, opt_a), (b, opt_b)):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    held[7:20] = 0.0
    opt_b.synchronize()
    sd = opt_b.state_dict()
    sd["state"][0]["exp_avg"][7:20] = 0.0
    opt_b.load_state_dict(sd)
    train(a, opt_a, 1, 3)
    train(b, opt_b, 1, 3)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    opt_a.close()
    opt_b.close()


def test_held_moment_write_with_a_negative_second_moment_is_refused():
    p = torch.randn(N)
    opt = offload.AdamW([p], lr=1e-3, moments="8bit")
    _run(opt, [p], 1)
    before = {k: t.clone() for k, t in testing.raw_state(opt, p).items()}
    v = opt.state[p]["exp_avg_sq"]
    v[0] = -1.0
    with pytest.raises(ValueError, match=r"parameter 0 of group 0, written in place.*negative"):
        _run(opt, [p], 1)
    with pytest.raises(ValueError, match="negative"):   # every read of the state says so too
        opt.state_dict()
    v[0] = 0.0
    del v
    after = testing.raw_state(opt, p)
    assert all(torch.equal(before[k], after[k]) for k in before)   # nothing changed
    assert int(opt.state[p]["step"]) == 1
