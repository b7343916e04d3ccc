"""torch.compile with GPU offload (fake device): the user's compiled model is compiled, without graph
breaks, in every schedule.

offload's global module pre-hooks (the forward order, observed until the first step(); the per-module
upload waits after it) also run inside the forwards that dynamo traces. Traced into, they broke the
graph, and dynamo gave up compiling the model: it then ran uncompiled in every step. On the CPU that
gave the same numbers; on a GPU, other kernels than overlap=False's and none of the speed-up.
"""
import pytest
import torch
import torch.nn as nn

import offload
from offload.device import FakeDevice

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


@pytest.mark.parametrize("opts", [dict(overlap=False), dict(), dict(step_during_backward=False)],
                         ids=["overlap=False", "eager", "deferred"])
def test_a_compiled_model_compiles_without_graph_breaks(opts):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
    fwd = torch.compile(model, backend="eager")
    opt = offload.AdamW(model.parameters(), lr=1e-2, offload_device=FakeDevice(max_delay=0.001, seed=1),
                        bucket_mb=0.001, **opts)
    try:
        for _ in range(3):
            fwd(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
    finally:
        opt.close()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
