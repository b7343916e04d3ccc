# test_optim_db.py: offload.Adam/AdamW through PyTorch's own optimizer database
# (torch.testing._internal.common_optimizers.optim_db, the inputs torch's test_optim.py runs):
# every constructor input gives torch's results (RAM state; NVMe/mmap on a sample; device parameters
# through CpuDevice / FakeDevice), its state_dict continues in torch.optim, every error input raises
# torch's error type with a matching message, and the flags torch's CPU tests exercise that offload
# does not implement are refused by name.
import atexit
import functools
import os
import re
import shutil
import tempfile
import warnings

import pytest
import torch

import offload

cot = pytest.importorskip("torch.testing._internal.common_optimizers",
                          reason="torch's optimizer database needs the `expecttest` package")
OptimizerErrorEnum = cot.OptimizerErrorEnum

INFOS = {info.optim_cls.__name__: info for info in cot.optim_db
         if info.optim_cls in (torch.optim.Adam, torch.optim.AdamW)}
# OFFLOAD_OPTIM_DB_STATE=nvme|mmap runs every test of this file with that state tier (one state
# directory for the run; each optimizer makes its own file in it); default: RAM state
DB_STATE = os.environ.get("OFFLOAD_OPTIM_DB_STATE", "ram")
assert DB_STATE in ("ram", "nvme", "mmap"), DB_STATE
if DB_STATE == "ram":
    OURS = {"Adam": offload.Adam, "AdamW": offload.AdamW}
else:
    _DB_DIR = tempfile.mkdtemp(prefix="offload-optim-db-")
    atexit.register(shutil.rmtree, _DB_DIR, True)
    OURS = {"Adam": functools.partial(offload.Adam, storage=DB_STATE, nvme_dir=_DB_DIR),
            "AdamW": functools.partial(offload.AdamW, storage=DB_STATE, nvme_dir=_DB_DIR)}
NAMES = sorted(INFOS)
assert NAMES == ["Adam", "AdamW"], NAMES


def _inputs(name, device="cpu"):
    return [(name, oi) for oi in INFOS[name].optim_inputs_func(device=device)]


CPU_INPUTS = [x for n in NAMES for x in _inputs(n)]
# inputs torch only runs on CUDA (capturable, Tensor lr/betas with capturable): offload refuses capturable
CUDA_ONLY = [x for n in NAMES for x in _inputs(n, "cuda")
             if x[1].desc not in {oi.desc for _, oi in _inputs(n)}]


def _ids(xs):
    return [f"{n}-{oi.desc.replace(' ', '_')}" for n, oi in xs]


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).to(dtype)


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(6, 5, generator=gen).to(dtype)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _compare(name, kw, dtype, state="ram", tmp_path=None, steps=4, foreach=False):
    m1, m2 = _model(dtype), _model(dtype)
    extra = {} if state == "ram" else dict(storage=state, nvme_dir=tmp_path)
    o1 = OURS[name](m1.parameters(), **dict(_kwargs_dict(kw), foreach=foreach), **extra)
    o2 = getattr(torch.optim, name)(m2.parameters(), **dict(_kwargs_dict(kw), foreach=foreach))
    _train(m1, o1, steps)
    _train(m2, o2, steps)
    for a, b in zip(m1.parameters(), m2.parameters()):
        if dtype == torch.float64 and not foreach:
            assert torch.equal(a, b)  # stepped by torch's own single-tensor code (offload/optim/fallback.py), any tier
        else:
            torch.testing.assert_close(a, b)
    return m1, m2, o1, o2


def _kwargs_dict(kw):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else
                tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in v) if isinstance(v, tuple) else v)
            for k, v in kw.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name,oi", CPU_INPUTS, ids=_ids(CPU_INPUTS))
def test_optim_db_input_matches_torch(name, oi, dtype):
    m1, m2, o1, o2 = _compare(name, oi.kwargs, dtype)
    # the state continues in torch.optim (and torch's in offload) with the same results
    t = getattr(torch.optim, name)(m1.parameters(), **_kwargs_dict(oi.kwargs))
    t.load_state_dict(o1.state_dict())
    o3 = OURS[name](m2.parameters(), **_kwargs_dict(oi.kwargs))
    o3.load_state_dict(o2.state_dict())
    _train(m1, t, 2, seed=7)
    _train(m2, o3, 2, seed=7)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name,oi", CPU_INPUTS, ids=_ids(CPU_INPUTS))
def test_optim_db_input_foreach_flag(name, oi):
    # foreach is accepted and has no effect on the math (one native kernel): torch's foreach results
    _compare(name, oi.kwargs, torch.float32, foreach=True)


@pytest.mark.parametrize("name,oi", CPU_INPUTS, ids=_ids(CPU_INPUTS))
@pytest.mark.parametrize("flag", ["fused", "differentiable", "capturable"])
def test_optim_db_unsupported_impls_are_refused_by_name(name, oi, flag):
    assert flag == "capturable" or flag in INFOS[name].supported_impls
    with pytest.raises(ValueError, match=f"{flag}=True is not supported|{flag}=True selects"):
        OURS[name](_model(torch.float32).parameters(), **_kwargs_dict(oi.kwargs), **{flag: True})


@pytest.mark.parametrize("name,oi", CUDA_ONLY, ids=_ids(CUDA_ONLY))
def test_optim_db_cuda_only_inputs(name, oi):
    assert oi.kwargs.get("capturable")
    with pytest.raises(ValueError, match="capturable=True is not supported"):
        OURS[name](_model(torch.float32).parameters(), **_kwargs_dict(oi.kwargs))
    # without capturable (Tensor lr / Tensor betas on CPU, which torch's for-loop path accepts): torch's results
    kw = {k: v for k, v in oi.kwargs.items() if k != "capturable"}
    _compare(name, kw, torch.float32)


@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
@pytest.mark.parametrize("side", ["cpu_eager", "fake_deferred"])
@pytest.mark.parametrize("name,oi", CPU_INPUTS, ids=_ids(CPU_INPUTS))
def test_optim_db_input_device_params(name, oi, side, fmt):
    """The same inputs with the parameters treated as device parameters (GPU-offload mode through
    CpuDevice / FakeDevice, one bucket per tensor): torch's results (8bit: with its moments quantized
    after each step, as test_optim_db_inputs_with_compressed_moments)."""
    from offload.device import CpuDevice, FakeDevice
    m1, m2 = _model(torch.float32), _model(torch.float32)
    dev, extra = (CpuDevice(), {}) if side == "cpu_eager" else (FakeDevice(max_delay=0.002), dict(step_during_backward=False))
    if fmt != "fp32":
        extra.update(moments=fmt, moments_min_size=0)
        if oi.kwargs.get("amsgrad"):
            with pytest.raises(ValueError, match="amsgrad"):
                OURS[name](m1.parameters(), **_kwargs_dict(oi.kwargs), offload_device=dev, **extra)
            return
    o1 = OURS[name](m1.parameters(), **_kwargs_dict(oi.kwargs), offload_device=dev, bucket_mb=0.0001, **extra)
    o2 = getattr(torch.optim, name)(m2.parameters(), **_kwargs_dict(oi.kwargs))
    if fmt != "fp32":
        o2.register_step_post_hook(lambda opt, args, kwargs: _quantize_state(opt, fmt))
    _train(m1, o1, 4)
    _train(m2, o2, 4)
    o1.synchronize()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b)
    o1.close()


# every constructor input torch runs on CPU, and the CUDA-only ones without capturable (Tensor lr / betas)
ALL_INPUTS = CPU_INPUTS + [(n, oi) for n, oi in CUDA_ONLY]


def _quantize_state(opt, fmt):
    """torch's moments through the format's encoder and decoder (offload/moments/format.py, the kernel's
    bytes): after torch's step this is what a compressed step is (decode -> fp32 update -> encode)."""
    from offload.moments import format as mformat
    for st in opt.state.values():
        m, v = st["exp_avg"], st["exp_avg_sq"]
        f = mformat.moment_format(fmt)
        dm, dv = f.decode(f.encode(m.reshape(-1), v.reshape(-1)))
        m.copy_(dm.view_as(m))
        v.copy_(dv.view_as(v))


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.parametrize("name,oi", ALL_INPUTS, ids=_ids(ALL_INPUTS))
def test_optim_db_inputs_with_compressed_moments(name, oi, fmt):
    """Every input with moments="bf16"/"8bit" (every tensor compressed): torch's steps with its moments
    quantized after each step, or amsgrad refused by name. A flag the compressed path dropped or
    misread would move the parameters by about lr per step, far outside the tolerance."""
    kw = {k: v for k, v in _kwargs_dict(oi.kwargs).items() if k != "capturable"}
    m1, m2 = _model(torch.float32), _model(torch.float32)
    if kw.get("amsgrad"):
        with pytest.raises(ValueError, match="amsgrad"):
            OURS[name](m1.parameters(), moments=fmt, moments_min_size=0, **kw)
        return
    o1 = OURS[name](m1.parameters(), moments=fmt, moments_min_size=0, **kw)
    o2 = getattr(torch.optim, name)(m2.parameters(), **_kwargs_dict(kw))
    o2.register_step_post_hook(lambda opt, args, kwargs: _quantize_state(opt, fmt))
    _train(m1, o1, 4)
    _train(m2, o2, 4)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(o1.state[p1][key], o2.state[p2][key])


SAMPLE = [x for x in CPU_INPUTS if x[0] == "AdamW" and x[1].desc in ("default", "amsgrad", "maximize")]


@pytest.mark.parametrize("state", ["nvme", "mmap"])
@pytest.mark.parametrize("name,oi", SAMPLE, ids=_ids(SAMPLE))
def test_optim_db_sample_disk_state(name, oi, state, tmp_path):
    m1, m2, o1, o2 = _compare(name, oi.kwargs, torch.float32, state=state, tmp_path=tmp_path)
    t = torch.optim.AdamW(m2.parameters(), **_kwargs_dict(oi.kwargs))
    t.load_state_dict(o1.state_dict())
    for k, v in o2.state_dict()["state"].items():
        for key, val in v.items():
            torch.testing.assert_close(t.state_dict()["state"][k][key], val)
    o1.close()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("state", ["nvme", "mmap"])
@pytest.mark.parametrize("name,oi", CPU_INPUTS, ids=_ids(CPU_INPUTS))
def test_optim_db_all_inputs_disk_state(name, oi, state, dtype, tmp_path):
    # float64: every parameter stepped by torch's code, state in host RAM (bitwise, in _compare)
    _compare(name, oi.kwargs, dtype, state=state, tmp_path=tmp_path)[2].close()


def _errors(dtype=torch.float32):
    return [(n, e) for n in NAMES for e in INFOS[n].optim_error_inputs_func(device="cpu", dtype=dtype)]


ERRORS = _errors()


@pytest.mark.parametrize("name,ei", ERRORS, ids=[f"{n}-{e.optimizer_error_input.desc[:60].replace(' ', '_')}"
                                                 for n, e in ERRORS])
def test_optim_db_error_inputs(name, ei):
    oi = ei.optimizer_error_input
    # torch's test_errors: params=None means one sample parameter
    params = oi.params if oi.params is not None else [torch.nn.Parameter(torch.randn(2, 3))]

    def run():
        opt = OURS[name](params, **_kwargs_dict(oi.kwargs))
        if ei.error_on == OptimizerErrorEnum.STEP_ERROR:
            for g in opt.param_groups:
                for p in g["params"]:
                    p.grad = torch.zeros_like(p)
            opt.step()

    if issubclass(ei.error_type, Warning):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            run()
        assert any(issubclass(x.category, ei.error_type) and re.search(ei.error_regex, str(x.message)) for x in w), \
            [str(x.message) for x in w]
    else:
        with pytest.raises(ei.error_type, match=ei.error_regex):
            run()
        # and torch raises the same there (the database is the reference)
        with pytest.raises(ei.error_type, match=ei.error_regex):
            getattr(torch.optim, name)(params, **_kwargs_dict(oi.kwargs))


# ---------------------------------------------------------------- the parameters torch's test_optim.py adds
# (test_complex, non-contiguous views, a parameter listed twice, test_deepcopy_copies_all_public_attrs) over
# the database inputs, in every state tier: the native kernel takes none of them, torch's own code steps them
# (offload/optim/fallback.py) with their state in host RAM in torch's layout, bit for bit torch's results
STATES = ["ram", "nvme", "mmap", "ram-8bit", "nvme-bf16"]


def _odd_params():
    g = torch.Generator().manual_seed(3)

    def P(*shape, dtype=torch.float32):
        return torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype))
    dup = P(4)
    return [P(3, 2, dtype=torch.float64), torch.nn.Parameter(torch.randn(5, dtype=torch.complex64, generator=g)),
            torch.nn.Parameter(P(4, 3).data.t()), dup, P(6), dup]


def _odd_run(make, steps=3, seed=5):
    gen = torch.Generator().manual_seed(seed)
    ps = make()
    for _ in range(steps):
        for p in {id(p): p for p in ps}.values():
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
        yield ps


def _opt_kw(state, tmp_path):
    state, _, moments = state.partition("-")
    return dict({} if state == "ram" else dict(storage=state, nvme_dir=tmp_path), **({"moments": moments} if moments else {}))


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("name,oi", CPU_INPUTS, ids=_ids(CPU_INPUTS))
def test_optim_db_odd_params_match_torch_bitwise(name, oi, state, tmp_path):
    if "-" in state and oi.kwargs.get("amsgrad"):
        with pytest.raises(ValueError, match="amsgrad"):
            getattr(offload, name)(_odd_params(), **_kwargs_dict(oi.kwargs), **_opt_kw(state, tmp_path))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # torch's duplicate-parameter warning
        ours = theirs = None
        a = b = None
        for a in _odd_run(_odd_params):
            ours = ours or getattr(offload, name)(a, **_kwargs_dict(oi.kwargs), **_opt_kw(state, tmp_path))
            ours.step()
        for b in _odd_run(_odd_params):
            theirs = theirs or getattr(torch.optim, name)(b, **_kwargs_dict(oi.kwargs))
            theirs.step()
    for i, (x, y) in enumerate(zip(a, b)):
        if i == 4:   # the dense float32 parameter: the native kernel
            torch.testing.assert_close(x, y)
            continue
        assert torch.equal(x, y), i
        for key, v in theirs.state[y].items():
            assert torch.equal(ours.state[x][key], v) and ours.state[x][key].dtype == v.dtype, (i, key)
    # the state continues in torch.optim with the same results, and torch's in offload
    sd = ours.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = getattr(torch.optim, name)(b, **_kwargs_dict(oi.kwargs))
    t.load_state_dict(sd)
    for k, v in theirs.state_dict()["state"].items():
        for key, val in v.items():
            torch.testing.assert_close(t.state_dict()["state"][k][key], val, rtol=0, atol=0 if k != 4 else 1e-6)
    ours.close()


@pytest.mark.parametrize("state", STATES)
def test_optim_db_deepcopy_copies_all_public_attrs(state, tmp_path):
    """torch's test_deepcopy_copies_all_public_attrs: RAM state is deep-copied with every public
    attribute; a state file is refused by name (use state_dict / load_state_dict)."""
    import copy
    m = _model(torch.float32)
    opt = offload.AdamW(m.parameters(), **_opt_kw(state, tmp_path))
    _train(m, opt, 3)
    if state != "ram":
        with pytest.raises(TypeError, match="cannot be pickled or deep-copied; use state_dict"):
            copy.deepcopy(opt)
        opt.close()
        return
    attrs = {k for k in opt.__dict__ if not k.startswith("_")}
    assert attrs == {k for k in copy.deepcopy(opt).__dict__ if not k.startswith("_")}
