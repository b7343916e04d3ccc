"""tests/test_plan_time.py: the planner's step-time model (offload/steptime.py) with injected bandwidths,
its bytes against a real optimizer, the bandwidth JSON it reads (offload/bandwidth.py), the setup it
suggests and plans from a Hugging Face config.json. No figure here depends on how fast this machine is."""
import json

import pytest
import torch

import offload
from offload import planner
from offload.bandwidth import Bandwidths, from_json, pass_bytes
from offload.bench.__main__ import main as bench_main
from offload.steptime import Stage, pipeline_seconds

GB = 1e9


def _meta(n: int, k: int, dtype=torch.bfloat16) -> list:
    return [torch.empty(n // k, dtype=dtype, device="meta") for _ in range(k)]


def test_pass_bytes():
    assert pass_bytes("fp32", 4, 0) == 28                          # fp32 p, g, m, v read; p, m, v written
    assert pass_bytes("fp32", 2, 2) == 28                          # bf16 grad in, bf16 weight out, fp32 master
    assert pass_bytes("fp32", 4, 0, amsgrad=True) == 36
    assert pass_bytes("bf16", 4, 0) == 20
    assert pass_bytes("8bit", 4, 0, numel=512) == 16 + 16 * 2 / 512   # + one fp32 scale per 256 of m and v


def test_pipeline_arithmetic():
    bw = Bandwidths(kernel=10, read=100, write=50, mixed=60)
    # kernel 1 s, read 1 s, write 2 s per bucket; a slot that reads and writes: 300 bytes at 60 = 5 s
    three = [Stage(kernel=10, read=100, write=100)] * 3
    r = pipeline_seconds(three, bw)
    # fill (read 0) 1 + slot0 max(1, read 1: 1) + slot1 max(1, r2+w0: 200/60) + slot2 max(1, w1: 2) + drain 2
    assert r["seconds"] == pytest.approx(1 + 1 + 200 / 60 + 2 + 2)
    assert r["fill_s"] == 1 and r["drain_s"] == 2 and r["bottleneck"] == "the disk"
    assert r["alone"] == {"kernel_s": 3, "read_s": 3, "write_s": 6}
    slow = Bandwidths(kernel=1, read=100, write=50, mixed=60)     # kernel 10 s per bucket: it bounds
    assert pipeline_seconds(three, slow)["seconds"] == pytest.approx(1 + 30 + 2)
    assert pipeline_seconds(three, slow)["bottleneck"].startswith("the kernel")
    # no mixed figure: reads and writes of one slot one after the other
    serial = pipeline_seconds(three, Bandwidths(kernel=10, read=100, write=50))
    assert serial["seconds"] == pytest.approx(1 + 1 + (1 + 2) + 2 + 2)
    # device parameters: copies down for k+1 and up for k-1 overlap the kernel of k
    dev = [Stage(kernel=10, d2h=40, h2d=40)] * 2
    r = pipeline_seconds(dev, Bandwidths(kernel=10, d2h=20, h2d=10))
    assert r["seconds"] == pytest.approx(2 + max(1, 2) + max(1, 4) + 4)
    assert pipeline_seconds([Stage(kernel=28)], Bandwidths(kernel=14))["seconds"] == 2   # RAM: the kernel alone
    with pytest.raises(ValueError, match="disk read bandwidth"):
        pipeline_seconds(three, Bandwidths(kernel=10))


@pytest.mark.parametrize("dtype,out", [(torch.float32, 0), (torch.bfloat16, 2)])
def test_ram_prediction_is_bytes_over_kernel_bandwidth(dtype, out):
    size = 2 if dtype == torch.bfloat16 else 4
    p = offload.plan(_meta(1 << 20, 4, dtype), device="cpu", bandwidths={"kernel": 7 * GB})
    assert p.step_time.buckets == 1
    assert p.step_time.seconds == pytest.approx((1 << 20) * pass_bytes("fp32", size, out) / (7 * GB))
    assert "predicted step" in str(p) and p.to_dict()["step_time"]["seconds"] == p.step_time.seconds


@pytest.mark.timeout(60)
def test_nvme_buckets_and_bytes_match_the_optimizer(tmp_path):
    """The plan's buckets are the optimizer's, and one step moves the bytes the model counts."""
    torch.manual_seed(0)
    params = [torch.randn(40_000, dtype=torch.bfloat16) for _ in range(5)]
    budget = 1 << 20
    bw = Bandwidths(kernel=10 * GB, read=2 * GB, write=1 * GB, mixed=1.5 * GB)
    p = offload.plan(params, device="cpu", storage="nvme", host_budget=budget, nvme_dir=str(tmp_path), bandwidths=bw)
    from offload import steptime
    opt = offload.AdamW(params, storage="nvme", nvme_dir=tmp_path, host_budget=budget)
    try:
        for q in params:
            q.grad = torch.randn_like(q)
        opt.step()                                   # the first step only writes fresh state
        before = opt.storage_info()
        opt.step()
        info = opt.storage_info()
        assert p.step_time.buckets == info["buckets"] > 2
        assert p.step_time.parts["read_s"] * bw.read == pytest.approx(info["bytes_read"] - before["bytes_read"])
        assert p.step_time.parts["write_s"] * bw.write == pytest.approx(info["bytes_written"] - before["bytes_written"])
        assert p.step_time.parts["read_s"] * bw.read == info["file_bytes"]
    finally:
        opt.close()
    assert p.step_time.seconds > max(p.step_time.parts["read_s"], p.step_time.parts["kernel_s"])
    assert steptime.predict([], bw, state="mmap") is None


def test_bandwidth_json(tmp_path):
    """The keys the benchmarks write (bench kernel's results records, bench io's medians) are the ones read."""
    kern = {"results": [
        dict(case="fp32 flat 32M", threads=1, impl="offload.AdamW.step", seconds=0.2, params=1000),
        dict(case="fp32 flat 32M", threads=2, impl="offload.AdamW.step", seconds=0.1, params=1000),
        dict(case="fp32 flat 32M", threads=2, impl="torch AdamW(fused=True)", seconds=0.05, params=1000),
        dict(case="bf16 grad+out, flat 32M", threads=2, impl="offload.AdamW.step", seconds=0.4, params=1000),
        dict(case="moments", threads=2, impl="8bit moments, fp32 grad", seconds=0.5, params=1024)]}
    io = {"bench": "io", "dir": "/x", "results": {"ours": {"read": 2e9, "write": 1e9}, "pwrite": {"read": 9e9}}}
    (tmp_path / "k.json").write_text(json.dumps(kern))
    (tmp_path / "io.json").write_text(json.dumps(io))
    paths = f"{tmp_path / 'k.json'},{tmp_path / 'io.json'}"
    bw = from_json(paths)
    assert bw.kernel == 1000 * 28 / 0.1 and bw.read == 2e9 and bw.write == 1e9 and bw.mixed is None
    assert bw.disk_mixed() == pytest.approx(2 / (1 / 2e9 + 1 / 1e9))
    assert from_json(paths, threads=1).kernel == 1000 * 28 / 0.2
    assert from_json(paths, param_dtype=torch.bfloat16).kernel == 1000 * 28 / 0.4
    assert from_json(paths, moments="8bit").kernel == pytest.approx(1024 * (16 + 16 * 4 / 1024) / 0.5)
    with pytest.raises(ValueError, match="no kernel record for moments='bf16'"):
        from_json(paths, moments="bf16")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a JSON of python -m offload.bench"):
        from_json(str(tmp_path / "bad.json"))
    p = offload.plan(_meta(1 << 20, 2, torch.float32), device="cpu", storage="nvme", nvme_dir=str(tmp_path),
                     bandwidths=paths)
    assert p.step_time.sources["kernel"].startswith(str(tmp_path / "k.json"))
    assert any("one after the other" in n for n in p.step_time.notes)


def test_cli_from_json_and_old_flag(tmp_path, capsys):
    kern = {"results": [dict(case="bf16 grad+out, flat 1M", threads=2, impl="offload.AdamW.step", seconds=0.01,
                             params=1 << 20)]}
    (tmp_path / "k.json").write_text(json.dumps(kern))
    rc = bench_main(["plan", "--params", "4M", "--tensors", "4", "--device", "cpu", "--from-json",
                     str(tmp_path / "k.json"), "--json", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "predicted step" in out and "in 4 tensors" in out
    st = json.loads((tmp_path / "p.json").read_text())["step_time"]
    assert st["seconds"] == pytest.approx(4e6 * 28 / ((1 << 20) * 28 / 0.01))
    assert bench_main(["plan", "--params", "1M", "--device", "cpu", "--state", "nvme", "--nvme-path",
                       str(tmp_path)]) == 0           # the old spelling of --nvme-dir still works
    with pytest.raises(SystemExit) as e:
        bench_main(["plan", "--hf-config", str(tmp_path / "nothing")])
    assert e.value.code == 2 and "no config.json" in capsys.readouterr().err


def test_suggests_the_first_setup_that_fits(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(planner, "host_memory", lambda: {"MemAvailable": 14 * gib})
    n = gib   # fp32 params on the CPU: weights 4 + grads 4 + fp32 m, v 8 = 16 GiB; bf16 moments: 12 GiB
    p = offload.plan(n, device="cpu", param_dtype="fp32")
    assert p.fits()["host"] is False and p.suggestion.startswith('moments="bf16" fits')
    assert "suggestion: " in str(p)
    p = offload.plan(n, device="cpu", param_dtype="fp32", moments="bf16")
    assert p.suggestion is None
    p = offload.plan(n, device="cpu", param_dtype="fp32", amsgrad=True)   # compressed moments: no amsgrad
    assert p.suggestion.startswith('storage="nvme"') or p.suggestion.startswith("no setup")
    monkeypatch.setattr(planner, "host_memory", lambda: {"MemAvailable": 9 * gib})   # 8 GiB of weights + grads
    assert offload.plan(n, device="cpu", param_dtype="fp32").suggestion.startswith("no setup")
    assert "the weights and gradients alone need" in offload.plan(50 * n, device="cpu").suggestion


def test_suggests_fp32_state_on_nvme_when_it_fits_the_disk(monkeypatch):
    """fp32 parameters on the CPU have no master: their state file is 8 bytes a parameter, and a
    disk that holds it gets fp32 moments on NVMe, not compressed ones."""
    import collections
    import shutil
    gib = 1 << 30
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(planner, "host_memory", lambda: {"MemAvailable": 9 * gib})
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * gib, 91 * gib, 9 * gib))
    p = offload.plan(gib, device="cpu", param_dtype="fp32", host_budget="256MiB")
    assert p.fits()["host"] is False   # weights + grads 8 GiB, + fp32 moments 8 GiB in RAM
    assert p.suggestion.startswith('storage="nvme"') and "moments=" not in p.suggestion


def test_plan_from_a_hugging_face_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32)
    cfg.save_pretrained(tmp_path)
    model = transformers.GPT2LMHeadModel(cfg)           # the real thing, to count against
    want = sum(q.numel() for q in model.parameters())   # tied input/output embeddings counted once
    for where in (tmp_path, tmp_path / "config.json"):
        p = offload.plan(where, device="cpu")
        assert p.config["params"] == want and p.config["tensors"] == len(list(model.parameters()))
    rc = bench_main(["plan", "--hf-config", str(tmp_path), "--device", "cpu"])
    assert rc == 0


def test_the_iteration_with_state_kept_on_the_gpu():
    """gpu_state= in the planner: the fewest trailing buckets that end the CPU's part inside backward, within
    the budget (the optimizer's rule, base/overlap.py), and the iteration with them and with none."""
    import torch
    from offload.bench.gpt import GPT, PRESETS
    with torch.device("meta"):
        model = GPT(PRESETS["350m"]).bfloat16()
    bw = dict(kernel=110e9, d2h=50e9, h2d=50e9)
    got = {}
    for gs in (0, "1GiB", "2GiB", "64GiB"):
        p = offload.plan(model, device="cuda", bandwidths=bw, backward_s=0.042, forward_s=0.021, gpu_state=gs)
        got[gs] = sp = p.step_time.split
        assert sp["host_only_s"] == pytest.approx(0.063 + sp["host_only_exposed_s"])
        assert sp["gpu_bytes"] <= sp["budget"] and sp["iteration_s"] <= sp["host_only_s"]
    assert got[0]["gpu_buckets"] == 0 and got[0]["iteration_s"] == got[0]["host_only_s"] > 0.063
    assert 0 < got["1GiB"]["gpu_buckets"] < got["2GiB"]["gpu_buckets"] <= got["64GiB"]["gpu_buckets"]
    assert got["64GiB"]["exposed_s"] == 0 and got["64GiB"]["iteration_s"] == pytest.approx(0.063)
    assert got["64GiB"]["gpu_bytes"] < 64 << 30   # the fewest that hide it, not all that fit
    text = str(p.step_time)
    assert "predicted iteration  0.063 s with" in text and "with every state on the host" in text
    for bad, err in ((dict(backward_s=-1.0), "backward_s must be a number of seconds >= 0"),
                     (dict(forward_s=float("nan")), "forward_s must be a number of seconds >= 0"),
                     (dict(gpu_state="lots"), "gpu_state must be 'auto', a size")):
        with pytest.raises(ValueError, match=err):
            offload.plan(model, device="cuda", bandwidths=bw, **{"backward_s": 0.04, **bad})
