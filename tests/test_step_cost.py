# test_step_cost.py: the per-step Python of offload.AdamW must not grow with the number of tensors.
# Deterministic stand-in for a timing guard: sys.settrace counts the Python line events of one warm
# step() of host parameters in RAM (storage="ram") with 200 and then 400 tensors of 64 elements; the
# count may grow by at most MAX_GROWTH lines (the step is O(groups + buckets), never O(tensors)).
# Every Python line counts, torch's included (e.g. Tensor.__hash__ called from a native dict lookup).
import collections
import gc
import sys

import pytest
import torch

import offload

SMALL, FEW, MANY = 64, 200, 400
MAX_GROWTH = 8  # lines; a per-tensor loop of one line would add 200

MOMENTS = ["fp32", "bf16", "8bit"]   # host parameters, RAM state: the state engine in each moment format


def step_lines(opt, where=lambda filename: True):
    """(line events, Counter of lines per 'file:function') of one ``opt.step()``, counting the
    lines of the files ``where`` accepts."""
    lines = collections.Counter()

    def local(frame, event, arg):
        code = frame.f_code
        if event == "line" and where(code.co_filename):
            lines["/".join(code.co_filename.split("/")[-2:]) + ":" + code.co_name] += 1
        return local

    gc.collect()
    gc.disable()  # no finalizer may run inside the traced step
    sys.settrace(lambda frame, event, arg: local)
    try:
        opt.step()
    finally:
        sys.settrace(None)
        gc.enable()
    return sum(lines.values()), lines


def traced_step(n: int, moments: str):
    """(line events, Counter of lines per 'file:function') of the 4th step() over n small tensors."""
    gen = torch.Generator().manual_seed(n)
    params = [torch.nn.Parameter(torch.randn(SMALL, generator=gen)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(SMALL, generator=gen)
    # moments_min_size=0: small tensors get the compressed format too (the default keeps them fp32)
    opts = {} if moments == "fp32" else dict(moments=moments, moments_min_size=0)
    opt = offload.AdamW(params, lr=1e-3, threads=1, **opts)
    try:
        for _ in range(3):  # warm: state created, row caches and lazy imports done
            opt.step()
        return step_lines(opt)
    finally:
        opt.close()


@pytest.mark.parametrize("moments", MOMENTS)
def test_step_python_does_not_grow_with_tensor_count(moments):
    few, at_few = traced_step(FEW, moments)
    many, at_many = traced_step(MANY, moments)
    grew = {k: at_many[k] - at_few.get(k, 0) for k in at_many if at_many[k] - at_few.get(k, 0) > 0}
    top = sorted(grew.items(), key=lambda kv: -kv[1])[:6]
    assert many - few <= MAX_GROWTH, (
        f"moments={moments}: {few} Python lines per step() with {FEW} tensors, {many} with {MANY} "
        f"(+{many - few} > {MAX_GROWTH}); grown most: {top}")
