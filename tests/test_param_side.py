# test_param_side.py: the parameter side (offload/params/side.py) is one object, built with the
# state engine and kept for its life: the delayed update's HeldParams is built then, over the
# device side, never swapped in afterwards (one staging ring allocated, not two).
import pytest
import torch

import offload
from offload import testing
from offload.device import CpuDevice
from offload.params.device import DeviceParams
from offload.params.host import HostParams
from offload.schedule.delayed import HeldParams


class CountingDevice(CpuDevice):
    """CpuDevice counting the host buffers it hands out (pinned memory on CUDA)."""

    def __init__(self):
        super().__init__()
        self.buffers = 0

    def host_empty(self, numel, dtype):
        self.buffers += 1
        return super().host_empty(numel, dtype)


def _params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((64, 32), (300,), (17, 5))]


def _step(opt, ps, n=2):
    for k in range(n):
        for p in ps:
            p.grad = torch.full_like(p, 0.1 * (k + 1))
        opt.step()
    opt.synchronize()


@pytest.mark.parametrize("extrapolate", (False, True))
def test_delayed_update_allocates_one_staging_ring(extrapolate):
    """delay_updates=1 allocates the staging ring of the exact schedule once, plus the held weights
    of each bucket (two with extrapolation): its side is built with the engine, not after it."""
    counts = {}
    for delay in (0, 1):
        dev = CountingDevice()
        kw = dict(delay_updates=1, delay_extrapolate=extrapolate) if delay else {}
        opt = offload.AdamW(_params(), lr=1e-2, offload_device=dev, bucket_mb=0.001,
                            step_during_backward=False, **kw)
        counts[delay] = dev.buffers
        buckets = len(testing.state_engine(opt).layout.buckets)
        opt.close()
    assert buckets > 1
    assert counts[1] == counts[0] + buckets * (2 if extrapolate else 1), counts


@pytest.mark.parametrize("kind", ("host", "device", "delayed"))
def test_the_side_is_fixed_for_the_engine_life(kind, tmp_path):
    """The engine's side is one object from construction on (steps, add_param_group, a load); it
    cannot be replaced."""
    ps = _params()
    dev = dict(offload_device=CpuDevice(), bucket_mb=0.001)
    kw = {"host": {}, "device": dev, "delayed": dict(dev, delay_updates=1, delay_after=1)}[kind]
    opt = offload.AdamW(ps[:2], lr=1e-2, **kw)
    eng = testing.state_engine(opt)
    side = testing.side(opt)
    want = {"host": HostParams, "device": DeviceParams, "delayed": HeldParams}[kind]
    assert type(side) is want
    if kind == "delayed":
        assert type(side.inner) is DeviceParams
    _step(opt, ps[:2])
    opt.add_param_group({"params": [ps[2]]})
    _step(opt, ps)
    opt.load_state_dict(opt.state_dict())
    _step(opt, ps)
    assert testing.state_engine(opt) is eng and testing.side(opt) is side
    with pytest.raises(AttributeError):
        eng.side = HostParams(eng.groups)
    opt.close()
