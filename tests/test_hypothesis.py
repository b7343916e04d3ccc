# test_hypothesis.py: property tests of offload.Adam/AdamW against torch.optim.Adam/AdamW over random
# hyperparameters, shapes, dtypes and layouts (dense fp32 through the native kernel; float64, complex,
# transposed and repeated parameters through torch's own code, offload/optim/fallback.py).
import copy
import warnings

import pytest
import torch

import offload

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

hyper = st.fixed_dictionaries({
    "lr": st.floats(1e-5, 1.0),
    "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.5, 0.9999)),
    "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
    "weight_decay": st.sampled_from([0.0, 1e-2, 0.3]),
    "amsgrad": st.booleans(),
    "maximize": st.booleans(),
})
shape = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
layout = st.sampled_from(["dense", "dense", "dense", "float64", "complex64", "transposed", "repeated"])


def _make(shapes, kinds, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s, kind in zip(shapes, kinds):
        if kind == "float64":
            t = torch.randn(s, generator=g, dtype=torch.float64)
        elif kind == "complex64":
            t = torch.randn(s, generator=g, dtype=torch.complex64)
        elif kind == "transposed":
            t = torch.randn(tuple(reversed(s)), generator=g).permute(tuple(reversed(range(len(s)))))
        else:
            t = torch.randn(s, generator=g)
        p = torch.nn.Parameter(t)
        out.append(p)
        if kind == "repeated":
            out.append(p)
    return out


def _check(cls_name, kw, shapes, kinds, steps, seed):
    a, b = _make(shapes, kinds, seed), _make(shapes, kinds, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate-parameter warning (torch gives the same)
        oa = getattr(offload, cls_name)(a, **kw)
        ob = getattr(torch.optim, cls_name)(b, **kw, foreach=False)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for x, y in zip(a, b):
            gr = torch.randn(x.shape, generator=gen, dtype=x.dtype)
            x.grad, y.grad = gr, gr.clone()
        oa.step()
        ob.step()
    for i, (x, y) in enumerate(zip(a, b)):
        native = x.dtype == torch.float32 and x.is_contiguous() and sum(q is x for q in a) == 1
        if native:
            # fp32 kernel vs torch's op-by-op float32: tolerances scale with the update size (lr)
            torch.testing.assert_close(x, y, rtol=2e-5, atol=1e-6 + 1e-5 * kw["lr"] * steps)
        else:
            assert torch.equal(x, y), (i, kinds)
        assert float(oa.state[x]["step"]) == float(ob.state[y]["step"])


@FAST
@given(kw=hyper, shapes=st.lists(shape, min_size=1, max_size=3), data=st.data(),
       steps=st.integers(1, 4), seed=st.integers(0, 2**16), cls_name=st.sampled_from(["Adam", "AdamW"]))
def test_matches_torch(kw, shapes, data, steps, seed, cls_name):
    kinds = [data.draw(layout) for _ in shapes]
    _check(cls_name, kw, shapes, kinds, steps, seed)


@pytest.mark.slow
@SLOW
@given(kw=hyper, shapes=st.lists(shape, min_size=1, max_size=4), data=st.data(),
       steps=st.integers(1, 6), seed=st.integers(0, 2**16), cls_name=st.sampled_from(["Adam", "AdamW"]))
def test_matches_torch_many(kw, shapes, data, steps, seed, cls_name):
    kinds = [data.draw(layout) for _ in shapes]
    _check(cls_name, kw, shapes, kinds, steps, seed)


@FAST
@given(kw=hyper, shapes=st.lists(shape, min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_state_dict_round_trip_with_torch(kw, shapes, seed):
    """offload's state_dict loads into torch.optim.AdamW and both continue identically (and back)."""
    kinds = ["dense"] * len(shapes)
    a, b = _make(shapes, kinds, seed), _make(shapes, kinds, seed)
    oa = offload.AdamW(a, **kw)
    gen = torch.Generator().manual_seed(seed)
    for x in a:
        x.grad = torch.randn(x.shape, generator=gen)
    oa.step()
    for x, y in zip(a, b):
        y.data.copy_(x.data)
    ob = torch.optim.AdamW(b, **kw)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # state_dict() hands out references, as torch's
    back = offload.AdamW(_make(shapes, kinds, seed), **kw)
    back.load_state_dict(ob.state_dict())
    assert back.state_dict()["param_groups"] == oa.state_dict()["param_groups"]
    for x, y in zip(a, b):
        g = torch.randn(x.shape, generator=gen)
        x.grad, y.grad = g, g.clone()
    oa.step()
    ob.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=1e-6 + 1e-5 * kw["lr"])
