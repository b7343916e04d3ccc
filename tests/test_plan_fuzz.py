"""tests/test_plan_fuzz.py: random arguments, good and bad, to ``offload.plan`` and to ``python -m
offload.bench plan``: each gives a plan whose every figure is a byte count >= 0, or a refusal in
one line (ValueError or TypeError, OSError for a missing file; exit status 2 and one line on
stderr), never another exception, a traceback or a long wait. tests/test_plan_refusals.py pins the
message of each bad input."""
import json
import time

import pytest
import torch

import offload
from offload.planner import MemoryPlan

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_plan_refusals import HUGE_S, REFUSE_S, run_cli  # noqa: E402

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

ODD = [None, True, False, 0, -1, 1, 3, 65, 1.5, float("nan"), float("inf"), -float("inf"),
       2 ** 63, 10 ** 30, "", " ", "x", "8GiBB", "-1GiB", "nan", "1e400", [], [""], {},
       torch.float64, "fp8", b"x", object()]
MODEL = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
GOOD = {   # offload.plan's arguments: values it takes
    "model_or_params": [MODEL, 10 ** 6, 7e9,
                        [torch.empty(5000, device="meta"), {"params": torch.empty(3)}]],
    "device": ["cpu", "cuda", torch.device("cpu")],
    "param_dtype": ["bf16", torch.float16, "FP32"],
    "grad_dtype": ["fp32", torch.bfloat16],
    "storage": ["ram", "nvme", "mmap"],
    "amsgrad": [True, False],
    "world_size": [1, 4, 10 ** 9],
    "sharding": ["none", "zero1", "fsdp"],
    "bucket_bytes": [1, 4096, 10 ** 12],
    "depth": [1, 64],
    "host_budget": ["64MiB", 1 << 20, "1TiB"],
    "staging_slots": [1, 64],
    "nvme_dir": ["/tmp", ["/tmp"]],
    "activation_bytes": [0, 10 ** 9, 2.5e9],
    "verbose": [False],
    "moments": ["fp32", "bf16", "8bit"],
    "moments_min_size": [0, 10 ** 9],
    "bandwidths": [{"kernel": 1e10, "read": 1e9, "write": 1e9, "h2d": 1e10, "d2h": 1e10}],
    "threads": [None, 1, 1024],
    "suggest": [True, False],
}


def _value(name):
    return st.one_of(st.sampled_from(GOOD[name]), st.sampled_from(ODD))


@pytest.mark.timeout(600)
@FUZZ
@given(data=st.data())
def test_plan_gives_a_plan_or_one_line(data):
    names = data.draw(st.lists(st.sampled_from(sorted(GOOD)), min_size=1, max_size=4, unique=True))
    kw = {n: data.draw(_value(n), label=n) for n in names}
    what = kw.pop("model_or_params", MODEL)
    t = time.perf_counter()
    try:
        p = offload.plan(what, **kw)
    except (ValueError, TypeError, OSError) as e:
        assert "\n" not in str(e) and str(e), repr(e)
        assert time.perf_counter() - t < REFUSE_S
        return
    assert time.perf_counter() - t < HUGE_S
    assert isinstance(p, MemoryPlan) and p.rows
    assert all(isinstance(r.bytes, int) and r.bytes >= 0 for r in p.rows), p.rows
    assert all(p.total(place) >= 0 for place in ("gpu", "host", "nvme"))
    json.dumps(p.to_dict())
    str(p)


TEXT = ["", "0", "-1", "1", "2", "65", "1.5", "nan", "inf", "-inf", "1e400", "1e19", "abc",
        "8GiBB", "2GiB", "4KiB", "1,2", "1,2,3", "32,-1,5", ",", "fp8", "bf16", "ram", "nvme",
        "mmap", "cpu", "cuda", "zero1", "fsdp", "8bit", "{tmp}", "{tmp},{tmp}/b",
        "{tmp}/missing.json", "{tmp}/k.json", "{tmp}/bad.json", "100000000", "7B", "1e15"]
OPTIONS = ["--tensors", "--device", "--param-dtype", "--grad-dtype", "--storage",
           "--staging-slots", "--world-size", "--sharding", "--bucket-mb", "--depth",
           "--host-budget", "--nvme-dir", "--moments", "--moments-min-size", "--threads",
           "--from-json", "--activations-gb", "--state", "--nvme-path", "--hf-config", "--params",
           "--transformer"]


@pytest.mark.timeout(600)
@FUZZ
@given(data=st.data())
def test_cli_gives_a_plan_or_one_line(data, tmp_path_factory, capsys):
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "b").mkdir()
    (tmp / "bad.json").write_text("{oops")
    record = dict(case="bf16 grad+out, flat 1M", threads=1, seconds=0.01,
                  impl="offload.AdamW.step", params=1 << 20)
    (tmp / "k.json").write_text(json.dumps({"results": [record]}))
    subject = data.draw(st.sampled_from([["--params", "1M"], ["--transformer", "2,64,100"], []]))
    option = st.tuples(st.sampled_from(OPTIONS), st.sampled_from(TEXT))
    pairs = data.draw(st.lists(option, max_size=4))
    flags = data.draw(st.lists(st.sampled_from(["--amsgrad", "--bogus", "-x"]), max_size=1))
    argv = subject + [f"{o}={v.replace('{tmp}', str(tmp))}" for o, v in pairs] + flags
    rc, out, err, dt = run_cli(argv, capsys)
    if rc == 2:
        lines = err.strip().splitlines()
        one = len(lines) == 1 and lines[0].startswith("python -m offload.bench plan: error: ")
        assert one, (argv, err)
        assert dt < REFUSE_S, (argv, dt)
    else:
        assert rc in (0, 1) and not err and "offload memory plan" in out, (argv, rc, err)
        assert dt < HUGE_S, (argv, dt)
