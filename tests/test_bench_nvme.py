# test_bench_nvme.py: the io and step benchmarks run end to end on tiny sizes and write the JSON
# they promise. Speed is judged by the benchmarks themselves, never here.
import json
import os
import subprocess
import sys

import pytest


def _run(args, timeout=240, **kw):
    r = subprocess.run([sys.executable, "-m", "offload.bench"] + args, capture_output=True, text=True,
                       timeout=timeout, **kw)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.timeout(300)
def test_io_bench_tiny_run_writes_json(tmp_path):
    out = tmp_path / "io.json"
    png = tmp_path / "io.png"
    stdout = _run(["io", "--nvme-dir", str(tmp_path), "--size", "8MiB", "--request", "1MiB", "--reps", "1",
                   "--fio-depths", "1", "--fio-jobs", "", "--skip", "deepspeed", "--json", str(out), "--plot", str(png)])
    data = json.loads(out.read_text())
    assert data["results"]["ours"]["write"] > 0 and data["results"]["ours"]["read"] > 0
    assert data["results"]["ours"]["mixed"] > 0          # both directions at once (the planner reads it)
    assert {"pwrite", "memmap"} <= set(data["results"])
    assert "ours" in stdout and stdout.startswith("question: ") and data["question"] in stdout
    peer = [v for v in data["verdicts"] if v["against"] == "peer"]
    assert [v["op"] for v in peer] == ["write", "read"] and all(v["line"] in stdout for v in peer)
    assert png.exists() or "not drawn, matplotlib is not installed" in stdout
    assert [p for p in os.listdir(tmp_path) if p not in ("io.json", "io.png")] == []  # work files removed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("state", ["nvme", "mmap"])
def test_step_bench_tiny_run_writes_json(tmp_path, state):
    out = tmp_path / "step.json"
    flag = "--nvme-dir" if state == "nvme" else "--dir"   # --dir: the old spelling, still taken
    stdout = _run(["step", "--state", state, flag, str(tmp_path), "--params", "2e5", "--tensors", "3",
                   "--budget", "256KiB", "--steps", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["step_s"] > 0 and data["kernel_s"] > 0 and data["buckets"] > 1
    assert (data["io_s"] is not None) == (state == "nvme")
    assert "peak RSS" in stdout and stdout.startswith("question: ")
    assert data["verdict"]["line"] in stdout and data["verdict"]["speedup"] > 0
    assert [p for p in os.listdir(tmp_path) if p != "step.json"] == []


@pytest.mark.timeout(300)
def test_step_bench_spreads_the_state_over_several_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    out = tmp_path / "step.json"
    _run(["step", "--dir", f"{a},{b}", "--params", "2e5", "--tensors", "3", "--budget", "1MiB", "--steps", "1",
          "--no-ram", "--json", str(out)])
    assert json.loads(out.read_text())["step_s"] > 0
    assert os.listdir(a) == [] and os.listdir(b) == []   # each drive's work directory removed, theirs kept


@pytest.mark.timeout(300)
def test_step_bench_compares_moment_formats_in_one_run(tmp_path):
    out = tmp_path / "step.json"
    stdout = _run(["step", "--dir", str(tmp_path), "--params", "3e5", "--tensors", "2", "--budget", "1MiB",
                   "--steps", "1", "--no-ram", "--moments", "fp32,8bit", "--json", str(out)])
    data = json.loads(out.read_text())
    fp32, q8 = data["runs"]
    assert (fp32["moments"], q8["moments"]) == ("fp32", "8bit")
    assert q8["file_bytes"] < 0.75 * fp32["file_bytes"]   # bf16 params: 12 -> ~6 B/param on disk
    assert "[speed target] 8bit NVMe step <= 0.6x fp32" in stdout
    assert [p for p in os.listdir(tmp_path) if p != "step.json"] == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bench", ["io", "step"])
def test_default_dir_is_a_fresh_temp_dir_not_the_current_one(tmp_path, bench):
    """Without --dir the multi-GB files go to a new directory under the system temp dir (TMPDIR here),
    removed at the end; nothing is written into the current directory."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    out = tmp_path / "r.json"
    args = (["io", "--size", "8MiB", "--request", "1MiB", "--reps", "1", "--fio-depths", "1", "--fio-jobs", "",
             "--skip", "deepspeed"] if bench == "io" else
            ["step", "--params", "2e5", "--tensors", "2", "--budget", "256KiB", "--steps", "1", "--no-ram"])
    _run(args + ["--json", str(out)], cwd=cwd, env=dict(os.environ, TMPDIR=str(tmp)))
    data = json.loads(out.read_text())
    assert data["dir"] == str(tmp)
    assert os.listdir(cwd) == [] and os.listdir(tmp) == []   # the work directory was removed, tmp kept
