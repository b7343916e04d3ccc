"""test_atomic_grow.py: a parameter frozen when the optimizer was built (requires_grad=False: no
state laid out for it) gets its first gradient while a state drive is full, or while the staging
ring of device parameters cannot grow. The step raises and changes nothing (docs/failures.md): the
parameter still has no state, and once there is room the next step lays it out and training goes
on bitwise as a run that never met the full drive. NVMe state on one drive and on two (the second
one full), mmap state; host parameters and device parameters (FakeDevice) in the synchronous,
deferred, eager and delayed schedules; fp32 and 8-bit moments."""
import errno
import os

import pytest
import offload
from offload import testing
from offload.device import FakeDevice
from atomic_util import assert_same, model_step, snapshot, tiny_model
from conftest import Config, configs

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]
ROWS = [row.values[0] for row in configs(sides=("host", "fake"), tiers=("nvme", "mmap"),
                                         moments=("fp32", "8bit"),
                                         schedules=("sync", "deferred", "eager"), cover="all")]
FROZEN_UNTIL = 2   # steps run with the middle layer frozen


def build(cfg, dirs, **over):
    model = tiny_model(frozen=(2,))   # the middle layer frozen when the optimizer is built
    kw = {}
    if dirs:
        kw.update(storage=cfg.tier, nvme_dir=dirs if len(dirs) > 1 else dirs[0], host_budget=65536)
    if cfg.moments != "fp32":
        kw.update(moments=cfg.moments, moments_min_size=0)
    if cfg.device:
        kw.update(offload_device=FakeDevice(max_delay=0.001), bucket_mb=0.004, **cfg.schedule_kw)
    kw.update(over)
    return model, offload.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, **kw)


def train(model, opt, start, n):
    for s in range(start, start + n):
        if s == FROZEN_UNTIL:
            model[2].requires_grad_(True)
        model_step(model, opt, s)
    opt.synchronize()


def pair(cfg, dirs, ref_dirs, opts, **over):
    """Two equal runs, trained up to the unfreezing (delay_updates=1: both synchronized there)."""
    (model, opt), (ref, ropt) = build(cfg, dirs, **over), build(cfg, ref_dirs, **over)
    opts += [opt, ropt]
    for m, o in ((model, opt), (ref, ropt)):
        train(m, o, 0, FROZEN_UNTIL)
    assert not opt.state.get(model[2].weight)
    return model, opt, ref, ropt


def refused_then_bitwise(model, opt, ref, ropt, monkeypatch, match, code):
    """The unfrozen layer's first step is refused (twice: the first refusal left nothing
    half-grown) and changes nothing; once ``monkeypatch`` is undone training goes on bitwise as
    ``ropt``'s."""
    ps = list(model.parameters())
    before = snapshot(ps, opt)
    model[2].requires_grad_(True)
    for _ in range(2):
        with pytest.raises(OSError, match=match) as ei:
            model_step(model, opt, FROZEN_UNTIL)
        assert ei.value.errno == code
        opt.zero_grad()
        opt.synchronize()
        assert_same(snapshot(ps, opt), before)
        assert not opt.state.get(model[2].weight)
    monkeypatch.undo()   # room again: the next step lays the parameter out
    train(model, opt, FROZEN_UNTIL, 3)
    train(ref, ropt, FROZEN_UNTIL, 3)
    assert_same(snapshot(ps, opt), snapshot(list(ref.parameters()), ropt))


def drives(tmp_path, name, k):
    out = [tmp_path / f"{name}{i}" for i in range(k)]
    for d in out:
        d.mkdir()
    return [str(d) for d in out]


@pytest.mark.parametrize("cfg,ndrives", [pytest.param(c, k, id=f"{c.id}-{k}drive") for c in ROWS
                                         for k in ((1, 2) if c.tier == "nvme" else (1,))])
def test_first_gradient_on_a_full_drive_changes_nothing(cfg, ndrives, tmp_path, opts, monkeypatch):
    dirs = drives(tmp_path, "a", ndrives)
    model, opt, ref, ropt = pair(cfg, dirs, drives(tmp_path, "b", ndrives), opts)
    full = dirs[-1]
    real = os.posix_fallocate

    def fallocate(fd, off, n):
        path = os.readlink(f"/proc/self/fd/{fd}")   # the state file (an export file may grow)
        if path.startswith(full + os.sep) and path.endswith("state.bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, off, n)
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    refused_then_bitwise(model, opt, ref, ropt, monkeypatch, f"not enough space in {full} ",
                         errno.ENOSPC)


def _no_memory(*a, **k):
    raise OSError(errno.ENOMEM, "Cannot allocate memory (injected)")


@pytest.mark.parametrize("schedule", ["sync", "deferred", "eager", "delayed"])
def test_first_gradient_when_the_staging_cannot_grow_changes_nothing(schedule, opts, monkeypatch):
    # RAM state, device parameters: the state grows, the staging ring cannot; the growth is undone
    cfg = Config("fake", "ram", "fp32", "deferred" if schedule == "delayed" else schedule)
    over = dict(delay_updates=1, delay_after=1) if schedule == "delayed" else {}
    model, opt, ref, ropt = pair(cfg, [], [], opts, **over)
    monkeypatch.setattr(testing.side(opt), "allocate", _no_memory)
    refused_then_bitwise(model, opt, ref, ropt, monkeypatch, "injected", errno.ENOMEM)
