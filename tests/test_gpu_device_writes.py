"""test_gpu_device_writes.py: GPU-offload pipeline (fake device, offload/device/fake.py): what users
write into device parameters is kept: parameters loaded after construction, writes through p.data or the
parameter after synchronize() and between backward and step (deferred schedule), writes that later
synchronizing calls (state_dict, save/load, add_param_group) must not revert, and the fingerprints that
see every kind of change.

Parameters are CPU tensors that the pipeline treats as device tensors: every gradient goes down and
every weight goes up through background "streams" with random delays, and the fake device poisons copy
destinations and checks copy sources, so an ordering bug shows up as NaNs or as a recorded hazard.
"""
import tempfile

import pytest
import torch
import torch.nn as nn

import offload
from conftest import SCHEDULES, configs
from pipeline_util import FAKE, SCHED, Net, assert_same, cpu_mode, ours, torch_ref, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", configs(schedules=("eager", "sync"), **FAKE))
def test_parameters_written_after_construction_are_picked_up(dtype, cfg):
    # e.g. model.load_state_dict(pretrained) after the optimizer was built
    torch.manual_seed(7)
    pretrained = Net().to(dtype).state_dict()

    def factory_then_load(opts):
        def factory(model):
            opt = ours(**opts)(model)
            model.load_state_dict(pretrained)
            return opt
        return factory

    def load_then_cpu(model):
        model.load_state_dict(pretrained)
        return cpu_mode(model)
    got = train(factory_then_load(cfg.schedule_kw), dtype=dtype, steps=3)
    assert_same(got, train(load_then_cpu, dtype=dtype, steps=3))


def _write_through_data(partial, steps, visible=False):
    """Weight decay by hand / weight clipping as users write it, after synchronize() (docs/gpu.md),
    between steps (not after the last: a master that no step adopted yet is compared too).
    ``visible``: through the parameter instead of p.data (its version counter moves)."""
    done = []

    def write(model, opt):
        done.append(1)
        if len(done) == steps:
            return
        if isinstance(opt, offload.AdamW):
            opt.synchronize()
        with torch.no_grad():
            for k, p in enumerate(model.parameters()):
                t = p if visible else p.data
                if partial and k % 2:
                    t.clamp_(-0.05, 0.05)   # changes some elements only
                else:
                    t.mul_(0.99)
    return write


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dtype,partial", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                                           (torch.bfloat16, True)])
@pytest.mark.parametrize("cfg", configs(schedules=SCHEDULES, **FAKE))
def test_writes_through_data_after_synchronize_are_kept(cfg, dtype, partial):
    # p.data.mul_() moves no version counter: before the device fingerprints the next step overwrote
    # it with round(master) (a reverted write); torch's AdamW and the host path keep it
    # 5 steps: the layer used on even steps only is stepped last, so its master adopted the writes on
    # both sides (the host path adopts at the parameter's next step, the device path at the next backward)
    def write():
        return _write_through_data(partial, steps=5)
    got = train(ours(**cfg.schedule_kw), dtype=dtype, steps=5, after_step=write())
    assert_same(got, train(cpu_mode, dtype=dtype, steps=5, after_step=write()))
    if dtype == torch.float32:
        assert_same(got, train(torch_ref, steps=5, after_step=write()), exact=False)


def _write_then(then, steps, visible):
    """A write after synchronize() (_write_through_data), then ``then(opt)``: calls that synchronize
    or reload internally must not make the write look like our own weights."""
    write = _write_through_data(False, steps, visible)

    def after(model, opt):
        write(model, opt)
        then(opt)
    return after


def _sd_round_trip(opt):
    opt.load_state_dict(opt.state_dict())


def _save_load(opt):
    d = tempfile.mkdtemp(prefix="offload-wt-")
    offload.save(opt, d)
    offload.load(opt, d)


def _add_group(opt):
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(300))], "lr": 1e-3})


@pytest.mark.timeout(90)
@pytest.mark.parametrize("then", [lambda opt: opt.synchronize(), lambda opt: opt.state_dict(), _sd_round_trip,
                                  _save_load, _add_group],
                         ids=["synchronize", "state_dict", "load_state_dict", "save_load", "add_param_group"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("visible", [False, True], ids=["p.data", "p"])
def test_writes_survive_later_synchronizing_calls(dtype, then, visible):
    # a second synchronize() (or state_dict(), offload.save, load_state_dict, which synchronize) used
    # to take new fingerprints that included the write, and add_param_group / load_state_dict
    # restarted the version tracking: the next upload then reverted the write
    got = train(ours(**SCHED["eager"]), dtype=dtype, steps=5, after_step=_write_then(then, 5, visible))
    assert_same(got, train(cpu_mode, dtype=dtype, steps=5, after_step=_write_then(then, 5, visible)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_schedule_keeps_writes_made_between_backward_and_step(dtype):
    # deferred: nothing is stepped before step(), so a write after synchronize() that follows
    # backward must be what step() updates, as with torch (the eager schedule has stepped by then)
    def write():
        return _write_through_data(True, steps=5)
    got = train(ours(**SCHED["deferred"]), dtype=dtype, steps=5, before_step=write())
    assert_same(got, train(cpu_mode, dtype=dtype, steps=5, before_step=write()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_schedule_keeps_writes_through_the_parameter_between_backward_and_step(dtype):
    # a write that moves the version counter (no synchronize() needed: backward uploads nothing in
    # the deferred schedule) must be what step() updates too
    def write(model, opt):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.99)
    # 5 steps: the layer used on even steps only is stepped last, so both sides adopted the writes
    got = train(ours(**SCHED["deferred"]), dtype=dtype, steps=5, before_step=write)
    assert_same(got, train(cpu_mode, dtype=dtype, steps=5, before_step=write))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("native", [True, False])   # CPU tensors: native; a GPU's: torch's ops (forced here)
def test_fingerprints_see_every_kind_of_change(native):
    from offload.params.fingerprint import fingerprints
    torch.manual_seed(0)
    ts = [torch.randn(1000), torch.randn(77).bfloat16(), torch.randn(3, 5).half(), torch.randn((1 << 22) + 9)]
    base = fingerprints(ts, native=native)
    assert torch.equal(fingerprints(ts, native=native), base)             # deterministic

    def changed(k, edit):
        t = ts[k].clone()
        edit(t)
        return bool(torch.ne(fingerprints(ts[:k] + [t] + ts[k + 1:], native=native), base)[k])
    assert changed(0, lambda t: t.__setitem__(3, t[3] * (1 + 2 ** -23)))            # one ulp of one element
    assert changed(0, lambda t: t.__setitem__(slice(1, 3), t[[2, 1]]))              # two elements swapped
    assert changed(1, lambda t: t.neg_())
    assert changed(2, lambda t: t.__setitem__((2, 4), float("nan")))
    assert changed(3, lambda t: t.__setitem__(-1, t[-1] + 1))                       # the last chunk's tail
    assert changed(3, lambda t: t.__setitem__((1 << 22) + 1, t[1]))                 # copied across chunks
    assert not changed(0, lambda t: None)
    assert changed(1, lambda t: t.__setitem__(76, -t[76]))                          # an odd-length tail element


@pytest.mark.timeout(120)
@pytest.mark.parametrize("native", [True, False])
def test_fingerprints_see_uniform_scalings(native):
    # p.data.mul_(0.5) changes every element's bits by the same amount. With products wrapped mod
    # 2^32 the change of the sum was (wrap carries) * 2^32 minus a constant: it cancelled for 10 of
    # 300 random 1024-element tensors, and a halving write was silently reverted (found by
    # tests/test_differential.py seed 1256).
    from offload.params.fingerprint import fingerprints
    g = torch.Generator().manual_seed(0)
    for n in (1024, 2048, 4096, 8192):
        for dtype in (torch.float32, torch.bfloat16):
            ts = [torch.randn(n, generator=g).to(dtype) for _ in range(60)]
            base = fingerprints(ts, native=native)
            for factor in (0.5, 2.0, 0.25):
                got = fingerprints([t * factor for t in ts], native=native)
                same = torch.eq(got, base).nonzero().flatten().tolist()
                assert not same, f"{n} x {dtype}, * {factor}: fingerprint unchanged for tensors {same}"
