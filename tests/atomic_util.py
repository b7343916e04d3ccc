"""atomic_util.py: helpers of the every-step-is-atomic tests (test_atomic_*.py): deterministic
gradients, a tiny model, iterations of a model on deterministic batches, a bitwise snapshot of
parameters and optimizer state, and its comparison, the snapshot of an uninterrupted run (once per
mode); what a failed optimizer of device parameters refuses and allows (every_call_refused)."""
from __future__ import annotations

import pytest
import torch

import offload


def grads(params, step: int) -> None:
    """Deterministic gradients for ``step`` (the same in every run)."""
    for k, p in enumerate(params):
        g = torch.Generator().manual_seed(1000 * step + k)
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)


def train(params, opt, start: int, n: int) -> None:
    for s in range(start, start + n):
        grads(params, s)
        opt.step()


def tiny_model(frozen=()) -> torch.nn.Sequential:
    """Linear 16-64-64-4 with tanh between (the same weights every time); the layers ``frozen``
    (indices) get requires_grad=False."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 4))
    for i in frozen:
        model[i].requires_grad_(False)
    return model


def model_backward(model, s: int) -> None:
    """Backward of the deterministic batch ``s``: 8 x 16 inputs, in the dtype of the model's first
    parameter; the loss in fp32."""
    dtype = next(model.parameters()).dtype
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(s)).to(dtype)
    model(x).float().square().mean().backward()


def model_step(model, opt, s: int) -> None:
    """One iteration on batch ``s``: backward, step(), zero_grad()."""
    model_backward(model, s)
    opt.step()
    opt.zero_grad()


def train_model(model, opt, start: int, n: int) -> None:
    """model_step for the steps start .. start + n - 1, then opt.synchronize()."""
    for s in range(start, start + n):
        model_step(model, opt, s)
    opt.synchronize()


def uninterrupted(cache: dict, key, build, run) -> dict:
    """The snapshot of an uninterrupted run, made once per ``key``: ``build()`` gives (model, opt),
    ``run(model, opt)`` trains it; the optimizer is closed afterwards."""
    if key not in cache:
        model, opt = build()
        run(model, opt)
        cache[key] = snapshot(list(model.parameters()), opt)
        opt.close()
    return cache[key]


def _copy(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    return v


def snapshot(params, opt) -> dict:
    """Parameters, the whole state_dict (every tensor copied) and the pending clip coefficient."""
    return dict(params=[p.detach().clone() for p in params], state=_copy(opt.state_dict()["state"]),
                groups=[{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]],
                coef=opt.pending_grad_multiplier)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaN == NaN when the payloads are equal; -0.0 != 0.0)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(_bits(a), _bits(b)), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, (where, a, b)


def assert_same(a: dict, b: dict) -> None:
    """Bitwise: parameters (NaN payloads included), every state tensor and step, the clip coefficient."""
    assert len(a["params"]) == len(b["params"])
    for i, (x, y) in enumerate(zip(a["params"], b["params"])):
        _same(x, y, f"parameter {i}")
    _same(a["state"], b["state"], "state")
    assert a["coef"] == b["coef"]


def every_call_refused(model, opt, schedule):
    """Until a load: each call that steps or reads the state raises OptimizerFailedError (a backward
    too where buckets are stepped during it), every time; zero_grad and synchronize, which recovery
    may need, work; a forward and a backward that hand nothing to the optimizer work."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(99))
    for _ in range(2):
        if schedule == "eager":
            with pytest.raises(offload.OptimizerFailedError, match="load the last checkpoint"):
                model(x).square().mean().backward()
        else:
            model(x).square().mean().backward()
        with pytest.raises(offload.OptimizerFailedError, match="load the last checkpoint"):
            opt.step()
        with pytest.raises(offload.OptimizerFailedError):
            opt.state_dict()
        with pytest.raises(offload.OptimizerFailedError):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        opt.synchronize()
        opt.zero_grad(set_to_none=False)
        opt.zero_grad()
