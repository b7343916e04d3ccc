"""bench/gpu_check.py end to end on the fake device: one JSON line per check with its verdict, every
check of the GPU checklist present, a check that raises recorded as FAIL without stopping the others,
and a global budget too small for the checks giving SKIP lines instead of a crash; the checks' logic
(run_checks) on the fake device and on CUDA where there is one, and the script without CUDA."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload.bench.gpucheck import CHECK_NAMES

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
CHECKLIST = ["00_environment", "01_schedule_equivalence", "02_engine_claim", "03_parity_torch_adamw", "04_tiers",
             "05_moments", "06_accumulation", "07_clipping", "08_gradscaler", "09_bf16_autocast", "10_release_grads",
             "11_small_params", "12_user_writes", "13_non_owner_reads", "14_torch_compile", "15_user_stream",
             "16_fsdp2", "17_ddp", "18_robustness", "19_delayed_updates",
             "20_two_ranks"]
VERDICTS = {"PASS", "FAIL", "SKIP", "INFO"}


def _run(tmp_path, *extra, timeout=110):
    out = tmp_path / "checks.jsonl"
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "fake", "--out", str(out), *extra],
                       capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return r, lines


@pytest.mark.timeout(120)
def test_quick_fake_run_records_every_check_and_survives_a_failing_one(tmp_path):
    r, lines = _run(tmp_path, "--quick", "--inject-fail", "11_small_params")
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]   # the injected failure
    names = [x["name"] for x in lines]
    assert names == CHECK_NAMES, names                               # one line per check, in order
    for x in lines:
        assert set(x) >= {"name", "verdict", "seconds", "detail"} and x["verdict"] in VERDICTS, x
        assert f"{x['verdict']:<4}  {x['name']}" in r.stdout, x["name"]
    assert set(CHECKLIST) <= set(names)
    by = {x["name"]: x for x in lines}
    assert by["11_small_params"]["verdict"] == "FAIL" and "injected" in by["11_small_params"]["detail"]
    # the checks after the failing one still ran, and every other check passes on the fake device
    failed = [x["name"] + ": " + x["detail"][:300] for x in lines if x["verdict"] == "FAIL" and x["name"] != "11_small_params"]
    assert not failed, failed
    assert by["13_non_owner_reads"]["verdict"] == "PASS" and by["18_robustness"]["verdict"] == "PASS"
    assert by["15_user_stream"]["verdict"] == "SKIP"                 # CUDA only
    assert by["perf_offload_eager"]["verdict"] in {"INFO", "SKIP"}
    assert "summary:" in r.stdout


@pytest.mark.timeout(120)
def test_too_small_budget_gives_skip_lines_not_a_crash(tmp_path):
    r, lines = _run(tmp_path, "--quick", "--budget-s", "0.5", "--only", "00,01,04,18,perf_setup,perf_baseline")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert [x["name"] for x in lines] == ["00_environment", "01_schedule_equivalence", "04_tiers", "18_robustness",
                                          "perf_setup", "perf_baseline"]
    assert all(x["verdict"] == "SKIP" and "left of --budget-s" in x["detail"] for x in lines), lines
    assert "Traceback" not in r.stderr


@pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)
@pytest.mark.cuda
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_torch():
    from offload.bench.gpucheck import run_checks
    results = run_checks("cuda", steps=4, quick=True)
    assert results and all(r["ok"] for r in results), results


@pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)
@pytest.mark.timeout(120)
def test_gpu_check_logic_on_fake_device():
    from offload.bench.gpucheck import run_checks
    res = run_checks("fake", steps=3, quick=True)
    assert len(res) == 9 and all(r["ok"] for r in res), res
    assert max(r["rel_diff"] for r in res if r["dtype"] == "float32") < 1e-5


@pytest.mark.usefixtures("one_torch_thread")   # (conftest.py)
@pytest.mark.timeout(120)
def test_gpu_check_script_without_cuda_exits_cleanly():
    import subprocess
    import sys
    from pathlib import Path
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the script would run the real check")
    script = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0 and "no CUDA device" in r.stdout
