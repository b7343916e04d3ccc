"""test_failure_late_upload.py: a step that fails during backward (device parameters, the eager
schedule) must not leave an upload of its new weights in flight once the failure is raised. The
user restores the weights right after the exception (model.load_state_dict from a checkpoint); an
upload issued before the failure that lands after that load would silently put the failed step's
weights back into the model, and the next load of the optimizer's state would take them as the
master (docs/failures.md).

The uploads here start a fixed time after each is issued, and a layer
whose backward sleeps makes the failure of the second bucket's kernel surface at a later
parameter's gradient, inside the same backward: the path where the uploads of the step in
progress had not been handed to the compute stream's waits yet."""
import time

import pytest
import torch
import torch.nn as nn

import offload
from conftest import patch_kernels
from pipeline_util import HeldUploads
from tiny_models import slow_backward

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]

UPLOAD_DELAY_S = 0.6    # each upload lands this long after it is issued
BACKWARD_PAUSE_S = 0.25  # the first layer's backward starts this long after the last layers'


class Pause(nn.Module):
    def forward(self, x):
        return slow_backward(x, BACKWARD_PAUSE_S)


class Fault(Exception):
    pass


def _fail_second_kernel(monkeypatch):
    count = [0]

    def wrap(real):
        def failing(*a, **k):
            count[0] += 1
            if count[0] == 2:
                raise Fault("injected kernel failure")
            return real(*a, **k)
        return failing

    patch_kernels(monkeypatch, wrap)
    return count


def _mentions_fault(e) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, Fault):
            return True
        e = e.__cause__ or e.__context__
    return False


@pytest.mark.parametrize("storage", ["ram", "nvme"])
def test_no_upload_lands_after_a_failure_raised_in_backward(storage, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Pause(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    kw = dict(storage=storage, nvme_dir=str(tmp_path)) if storage == "nvme" else {}
    # 4 staging slots: the worker steps the next bucket while the last one's upload is in flight
    kw["nvme_options"] = {"staging_slots": 4}
    dev = HeldUploads(delay=UPLOAD_DELAY_S, max_delay=0.0)
    opt = offload.AdamW(model.parameters(), lr=0.1, offload_device=dev, bucket_mb=0.001, **kw)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = opt.state_dict()
    count = _fail_second_kernel(monkeypatch)
    with pytest.raises(Exception) as info:   # raised by a gradient hook of the first layer
        model(x).square().mean().backward()
    monkeypatch.undo()
    with torch.no_grad():
        model.load_state_dict(weights)
    time.sleep(UPLOAD_DELAY_S + 0.2)   # every upload issued before the failure has landed by now
    dev.synchronize()
    landed = [k for k, v in model.state_dict().items() if not torch.equal(v, weights[k])]
    opt.load_state_dict(state)   # recovered: close() works
    opt.close()
    assert count[0] >= 2
    assert _mentions_fault(info.value), repr(info.value)
    assert not landed, f"an upload of the failed step landed after the weights were loaded: {landed}"
