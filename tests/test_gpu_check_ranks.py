"""Check 20 of bench/gpu_check.py (2 ranks on one device against one process) end to end on the
fake device: every scenario of offload/bench/ranks.py reported by both ranks and passing, a
scenario that fails on one rank recorded as FAIL while the others still run, and the rank
processes ended at their timeout, or soon after one of them fails, never left behind."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offload.bench.gpucheck import CHECK_NAMES
from offload.bench.gpucheck_ranks import run_group
from offload.bench.ranks import SCENARIOS

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
NAME = "20_two_ranks"


def _check(tmp_path, *extra):
    out = tmp_path / "checks.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--device", "fake", "--only", NAME, "--out", str(out),
           *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    assert [x["name"] for x in lines] == [NAME], r.stdout[-2000:] + r.stderr[-2000:]
    return r, lines[0]


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(160)
def test_two_ranks_match_one_process_on_the_fake_device(tmp_path):
    assert NAME in CHECK_NAMES
    r, rec = _check(tmp_path)
    assert r.returncode == 0 and rec["verdict"] == "PASS", rec["detail"]
    data = rec["data"]
    assert data["probe"] and all(v is None for v in data["probe"].values()), data["probe"]
    for name in SCENARIOS:   # every scenario ran on both ranks, within the stated tolerance
        for rank in (0, 1):
            got = data[name][f"rank{rank}"]
            assert got["rtol"] == 2e-5 and 0 <= got["max_abs_diff"] <= 1e-5, (name, rank, got)
    assert [p["rc"] for p in data["processes"]] == [0, 0]
    assert all(_gone(p["pid"]) for p in data["processes"])


@pytest.mark.timeout(160)
def test_a_scenario_failing_on_one_rank_is_a_fail_and_the_others_still_run(tmp_path):
    r, rec = _check(tmp_path, "--inject-fail", f"{NAME}:zero1")
    assert r.returncode == 1 and rec["verdict"] == "FAIL", rec["detail"]
    assert rec["detail"].startswith(
        "zero1: 2 ranks == one process: errors={1: 'RuntimeError: failure injected")
    data = rec["data"]
    tracebacks = data["zero1"]["tracebacks"]
    assert "failure injected" in tracebacks["1"] and "0" not in tracebacks
    others = [n for n in SCENARIOS if n != "zero1"]
    for n in others:
        assert data[n]["tracebacks"] == {}, (n, data[n])
        assert data[n]["rank1"]["max_abs_diff"] <= 1e-5, (n, data[n])


def _sleeper(seconds):
    return [sys.executable, "-c", f"import time; time.sleep({seconds})"]


@pytest.mark.timeout(60)
def test_rank_processes_are_killed_at_the_timeout(tmp_path):
    t0 = time.time()
    out = run_group([_sleeper(60)] * 2, 1.0, [tmp_path / "a.log", tmp_path / "b.log"])
    assert time.time() - t0 < 10
    assert all(p["timed_out"] and p["killed"] and p["rc"] == -9 for p in out), out
    assert all(_gone(p["pid"]) for p in out)


@pytest.mark.timeout(60)
def test_the_other_ranks_are_killed_soon_after_one_fails(tmp_path):
    t0 = time.time()
    out = run_group([[sys.executable, "-c", "raise SystemExit(3)"], _sleeper(60)], 50.0,
                    [tmp_path / "a.log", tmp_path / "b.log"], grace_s=0.5)
    assert time.time() - t0 < 15
    assert [p["rc"] for p in out] == [3, -9] and [p["killed"] for p in out] == [False, True], out
    assert not any(p["timed_out"] for p in out) and all(_gone(p["pid"]) for p in out)


@pytest.mark.timeout(60)
def test_a_rank_exits_by_itself_when_its_parent_is_gone(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()   # a parent that no longer runs; the rank waits for a peer that never comes
    t0 = time.time()
    cmd = [sys.executable, "-m", "offload.bench.gpucheck_ranks", "--rank", "0", "--device", "fake",
           "--dir", str(tmp_path), "--out", str(tmp_path / "r.jsonl"), "--timeout", "40",
           "--parent", str(gone.pid)]
    r = subprocess.run(cmd, capture_output=True, timeout=50)
    assert r.returncode == 3 and time.time() - t0 < 30, (r.returncode, r.stderr[-1000:])
