# test_bench_gpu.py: `python -m offload.bench gpu` on the CPU: every row in a process of its own, results
# written as they come, the same first loss in every row, the table and the target lines; its budget,
# its timeouts and a row that dies. Speed means nothing here (a tiny model, offload through the fake device).
import importlib.util
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from offload.bench import gpu, gpu_rows, gpu_table


def _bench(tmp_path, *extra, timeout=240):
    r = subprocess.run([sys.executable, "-m", "offload.bench", "gpu", "--device", "cpu", "--out", str(tmp_path),
                        *extra], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (tmp_path / "gpu_bench.jsonl").read_text().splitlines()
    return r.stdout, json.loads(lines[0]), [json.loads(x) for x in lines[1:]]


def test_rows_train_the_same_model_from_the_same_weights(tmp_path):
    rows = "baseline,offload,offload_delayed,torch_fused,fsdp2_offload,torchao"
    stdout, head, res = _bench(tmp_path, "--rows", rows, "--iters", "2")
    assert head["kind"] == "run" and head["device"] == "cpu" and "torch" in head["versions"]
    got = {r["row"]: r for r in res}
    assert set(got) == set(rows.split(","))
    assert got["torchao"]["skipped"] == "needs CUDA"
    ran = {k: r for k, r in got.items() if "losses" in r}
    assert set(ran) == set(rows.split(",")) - {"torchao"}, {k: r.get("error") for k, r in got.items()}
    # every row starts from the same bf16 weights and batches: the same loss at iteration 0 ...
    assert len({r["losses"][0] for r in ran.values()}) == 1
    # ... and exact Adam from the same fp32 master gives the same later losses on the CPU, whoever steps it
    # (the delayed update trails by one step)
    exact = [ran[k]["losses"] for k in ("offload", "torch_fused", "fsdp2_offload")]
    assert exact[0] == exact[1] == exact[2]
    assert ran["offload_delayed"]["losses"][:2] == exact[0][:2] != ran["offload_delayed"]["losses"][2:]
    for r in ran.values():
        assert len(r["losses"]) == 1 + 2 and len(r["iter_ms"]) == 2 and r["host_median_ms"] > 0
        assert r["threads"]["torch"] >= 1 and r["setup_s"] >= 0 and r["host_peak_gb"] > 0
    assert ran["baseline"]["fwd_ms"] > 0 and ran["baseline"]["bwd_ms"] > 0
    assert ran["offload"]["threads"]["offload"] >= 1 and "cpu_step_ms" in ran["offload"]
    table = (tmp_path / "gpu_bench.md").read_text()
    assert table in stdout and "| tiny | offload.AdamW, stepped during backward |" in table
    assert "skipped: needs CUDA" in table and "(differs)" not in table
    assert "tiny: PASS iteration 0 loss equal in every row" in stdout


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.timeout(900)   # DeepSpeed JIT-builds its CPU Adam on first use
def test_deepspeed_zero2_row_matches_offload(tmp_path):
    _, _, res = _bench(tmp_path, "--rows", "offload,deepspeed_zero2", "--iters", "2", timeout=900)
    got = {r["row"]: r for r in res}
    assert got["deepspeed_zero2"]["losses"] == got["offload"]["losses"], got["deepspeed_zero2"].get("error")


def test_budget_skips_the_tail_and_says_so(tmp_path):
    t0 = time.perf_counter()
    _, _, res = _bench(tmp_path, "--rows", "baseline,offload", "--budget-s", "0")
    assert time.perf_counter() - t0 < 60
    assert [r.get("skipped") for r in res] == ["time budget spent (0 s)"] * 2


def _args(tmp_path, **kw):
    base = dict(device="cpu", sizes=None, rows=None, batch=None, warmup=None, iters=None, bucket_mb=None,
                keep_logs=True, out=str(tmp_path))
    return SimpleNamespace(**{**base, **kw})


def test_the_priority_order_and_unknown_rows(tmp_path):
    plan = gpu.plan(_args(tmp_path, device="cuda"))
    names = [(s, r.name) for s, r in plan]
    assert names[:2] == [("350m", "baseline"), ("350m", "offload")]
    assert names.index(("4b", "offload")) < names.index(("350m", "deepspeed_zenflow"))
    assert len(names) == len(set(names)) == len(gpu.PRIORITY)
    assert [r.name for _, r in gpu.plan(_args(tmp_path, rows="offload,baseline"))] == ["baseline", "offload"]
    with pytest.raises(SystemExit, match="unknown row.*nope"):
        gpu.plan(_args(tmp_path, rows="offload,nope"))


def test_a_row_that_dies_or_hangs_is_an_error_line(tmp_path, monkeypatch):
    row = gpu_rows.Row("baseline", "forward + backward alone", None)
    monkeypatch.setattr(gpu.sys, "executable", "/bin/false")
    out = gpu.run_row("tiny", row, _args(tmp_path), timeout=30)
    assert "exited with 1 and no result" in out["error"]
    sleeper = tmp_path / "sleeper"
    sleeper.write_text("#!/bin/sh\nsleep 60 &\nsleep 60\n")   # a helper process of its own, as ZenFlow has
    sleeper.chmod(0o755)
    monkeypatch.setattr(gpu.sys, "executable", str(sleeper))
    t0 = time.perf_counter()
    out = gpu.run_row("tiny", row, _args(tmp_path), timeout=1)
    assert out["error"] == "timed out after 1 s" and time.perf_counter() - t0 < 10
    assert subprocess.run(["pgrep", "-f", str(sleeper)], capture_output=True).returncode == 1


def _row(name, ms, loss0=1.0, **kw):
    return {"row": name, "size": "350m", "label": name, "event_median_ms": ms, "event_mean_ms": ms,
            "losses": [loss0, 0.5], **kw}


def test_targets_read_the_rows_of_one_size():
    res = [_row("baseline", 100.0, fwd_ms=30.0, bwd_ms=70.0, host_growth_gb=0.1),
           _row("offload", 105.0, cpu_step_ms=90.0, gpu_peak_gb=5.0),
           _row("offload_host", 105.0, cpu_step_ms=90.0, gpu_peak_gb=4.0),
           _row("offload_delayed", 110.0, cpu_step_ms=90.0),
           _row("deepspeed_zero2", 300.0, gpu_peak_gb=6.0),
           _row("torchao", 140.0, gpu_peak_gb=4.0, loss0=1.5)]
    lines = gpu_table.targets(res)
    assert "350m: PASS offload_host 105.0 ms <= forward 30.0 + max(backward 70.0, CPU step 90.0) + 10 % = 132.0 ms" \
        in lines
    assert "350m: PASS offload 105.0 ms <= 1.10x forward + backward (110.0 ms)" in lines
    assert any(x.startswith("350m: MISS offload_delayed 110.0 ms <= 1.05x") for x in lines)
    assert "350m: PASS offload 2.86x faster than deepspeed_zero2 (target >= 1.5x), GPU peak 5.0 vs 6.0 GB" in lines
    assert "350m: MISS offload 1.33x faster than torchao (target >= 1.5x), GPU peak 5.0 vs 4.0 GB" in lines
    assert lines[-1].startswith("350m: MISS iteration 0 loss equal in every row: ")
    table = gpu_table.markdown({"versions": {"torch": "x"}}, res + [{"row": "torch_fused", "size": "350m",
                                                                      "error": "out of memory: x", "gpu_peak_gb": 79.0}])
    assert "| 350m | torchao | 140.0 | 140.0 | - | 40.0 | 1.40 |" in table and "1.500000 (differs)" in table
    assert "error: out of memory: x (GPU peak 79.0 GB)" in table
