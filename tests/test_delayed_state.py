"""tests/test_delayed_state.py: ``opt.state`` read and written while a CPU step still runs after
step() returned (``delay_updates=1``: during the whole next forward and backward) shows and takes
what torch's would at that point: the state after the last ``step()``, and an in-place edit that the
next step uses (optim/adam.py ``state``); also after ``synchronize()`` with NVMe state, whose worker
then reads the next step's first buckets ahead (the exact deferred schedule too).

The CPU step is made slow deterministically: the fake device's copies to the host take 30 ms more
(``FakeDevice(d2h_delay=...)``), or the NVMe drive serves one bucket per 30 ms
(``offload.testing.slow_drive``), while a forward and backward take a few ms. The run is compared
with the rule written out (delayed_util.reference) with the same reads and edits at the same points.
Every tier and moment format.
"""
import pytest
import torch

from conftest import configs
from delayed_util import (assert_matches, batches, check_device, moment_opts, ours, reference,
                          tier_opts)
from offload import testing
from offload.device import FakeDevice

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)

SLOW = 0.03   # seconds: the CPU step's copies down, or each NVMe read and write
CONFIGS = [p.values[0] for p in configs(sides=("fake",), schedules=("deferred",), cover="all")]
CASES = ([pytest.param(1, False, c, id=f"delayed-{c.id}") for c in CONFIGS] +
         [pytest.param(delay, True, c, id=f"{name}-synchronized-{c.id}") for c in CONFIGS
          if c.tier == "nvme" for delay, name in ((1, "delayed"), (0, "exact"))])


def _edits(reads):
    """What a training loop does with ``opt.state`` between backward and step() at iterations 2
    and 4: log moments (kept in ``reads``) and scale some down in place, of parameters 0 and 6 (in
    the first and the last bucket: the first is read ahead for the next step with NVMe state)."""
    def between(t, opt, params):
        if t in (2, 4):
            for i in (0, 6):
                reads.append(opt.state[params[i]]["exp_avg_sq"].clone())
                opt.state[params[i]]["exp_avg"].mul_(0.5)
    return between


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay,sync,cfg", CASES)
def test_state_between_backward_and_step_is_torchs(delay, sync, cfg, tmp_path):
    """``sync``: ``opt.synchronize()`` before the reads and edits (the CPU step done; with NVMe
    state the worker then reads the next step's first buckets ahead)."""
    data = batches(6)
    got, want = [], []
    edit = _edits(got)

    def between(t, model, opt):
        if t == 0 and cfg.tier == "nvme":
            testing.slow_drive(opt, 0, SLOW)
        if sync and t in (2, 4):
            opt.synchronize()
        edit(t, opt, list(model.parameters()))
    device = FakeDevice(max_delay=0.002, seed=1, d2h_delay=0 if cfg.tier == "nvme" else SLOW)
    model, opt, losses = ours(torch.float32, data, device=device, delay=delay, between=between,
                              state_opts=dict(tier_opts(cfg, tmp_path), step_during_backward=False))
    ref = reference("offload", torch.float32, data, after=0 if delay else len(data),
                    sync={2, 4} if sync else (), opt_kw=moment_opts(cfg), between=_edits(want))
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"read {k}: max diff {(a - b).abs().max()}"
    assert losses == ref[0]
    assert_matches(model, opt, ref)
    check_device(opt)
    opt.close()
