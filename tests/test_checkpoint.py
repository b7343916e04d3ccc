"""Tests of offload.save / offload.load: exact resume, safetensors compatibility, corruption and
shape checks, crash safety under SIGKILL, asynchronous save."""
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import offload
from offload import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make(seed=0, hidden=16, amsgrad=True, cls=offload.AdamW):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4))
    model[2].to(torch.bfloat16)  # a low-precision group: state includes the fp32 master copy
    opt = cls([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-3}],
              lr=1e-2, amsgrad=amsgrad)
    return model, opt


def train(model, opt, steps, start):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 + s)
        x = torch.randn(5, 8, generator=g)
        h = model[1](model[0](x))
        loss = model[2](h.to(torch.bfloat16)).float().pow(2).mean()
        loss.backward()
        if isinstance(opt, offload.AdamW):
            opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()


def state_equal(a, b):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for kk in sa[k]:
            assert torch.equal(sa[k][kk], sb[k][kk]), (k, kk)


def data_file(d):
    return os.path.join(d, next(f for f in os.listdir(d) if f.endswith(".safetensors")))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", [offload.AdamW, torch.optim.AdamW])
def test_resume_is_bitwise_identical(tmp_path, cls):
    ref_model, ref_opt = make(cls=cls)
    train(ref_model, ref_opt, 6, 0)

    model, opt = make(cls=cls)
    train(model, opt, 3, 0)
    offload.save(opt, tmp_path / "ckpt")
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2 = make(seed=123, cls=cls)  # different init: everything must come from the files
    model2.load_state_dict(weights)
    offload.load(opt2, tmp_path / "ckpt")
    state_equal(opt, opt2)
    assert opt2.param_groups[1]["lr"] == 3e-3
    train(model2, opt2, 3, 3)
    for (n, a), b in zip(ref_model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), n
    state_equal(ref_opt, opt2)


@pytest.mark.timeout(30)
def test_file_is_safetensors_and_index_is_json(tmp_path):
    from safetensors import safe_open
    model, opt = make()
    train(model, opt, 2, 0)
    offload.save(opt, tmp_path)
    params = [p for g in opt.param_groups for p in g["params"]]
    with safe_open(data_file(tmp_path), "pt") as f:
        names = set(f.keys())
        for name in names:
            _, i, key = name.split(".", 2)
            assert torch.equal(f.get_tensor(name), opt.state[params[int(i)]][key])
    assert {"state.2.master_param", "state.0.max_exp_avg_sq"} <= names
    index = json.loads((tmp_path / "index.json").read_text())
    rank = json.loads((tmp_path / index["ranks"][0]["index"]).read_text())
    assert [p["step"] for p in rank["params"]] == [2.0] * 4
    assert all(isinstance(t["crc32"], int) for t in rank["tensors"])


@pytest.mark.timeout(30)
def test_resave_replaces_previous_generation(tmp_path):
    model, opt = make()
    train(model, opt, 1, 0)
    offload.save(opt, tmp_path)
    first = set(os.listdir(tmp_path))
    train(model, opt, 1, 1)
    offload.save(opt, tmp_path)
    second = set(os.listdir(tmp_path))
    assert len(second) == 3 and first & second == {"index.json"}


def _corrupt_and_check(tmp_path, mutate, match):
    model, opt = make()
    train(model, opt, 2, 0)
    offload.save(opt, tmp_path)
    mutate(tmp_path)
    model2, opt2 = make()
    train(model2, opt2, 1, 0)
    before = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt2.state_dict()["state"].items()}
    with pytest.raises(CheckpointError, match=match):
        offload.load(opt2, tmp_path)
    after = opt2.state_dict()["state"]
    for k in before:  # a refused load leaves the optimizer untouched
        for kk in before[k]:
            assert torch.equal(before[k][kk], after[k][kk])


@pytest.mark.timeout(30)
def test_bit_flip_detected(tmp_path):
    def flip(d):
        path = data_file(d)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 37)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    _corrupt_and_check(tmp_path, flip, "checksum mismatch .* corrupted")


@pytest.mark.timeout(30)
def test_truncation_detected(tmp_path):
    def trunc(d):
        path = data_file(d)
        os.truncate(path, os.path.getsize(path) - 100)
    _corrupt_and_check(tmp_path, trunc, "truncated")


@pytest.mark.timeout(30)
def test_rank_index_tampering_detected(tmp_path):
    def edit(d):
        name = next(f for f in os.listdir(d) if f.startswith("rank") and f.endswith(".json"))
        text = (d / name).read_text().replace('"step": 2.0', '"step": 7.0', 1)
        (d / name).write_text(text)
    _corrupt_and_check(tmp_path, edit, "rank index is corrupted")


@pytest.mark.timeout(30)
def test_wrong_shapes_refused(tmp_path):
    model, opt = make()
    train(model, opt, 1, 0)
    offload.save(opt, tmp_path)
    _, other = make(hidden=17)
    with pytest.raises(CheckpointError, match=r"parameter 0: checkpoint was saved for shape \(16, 8\).*\(17, 8\)"):
        offload.load(other, tmp_path)
    single = offload.AdamW(torch.nn.Linear(8, 16).parameters())
    with pytest.raises(CheckpointError, match="2 param group"):
        offload.load(single, tmp_path)


@pytest.mark.timeout(30)
def test_missing_checkpoint_is_clear(tmp_path):
    _, opt = make()
    with pytest.raises(CheckpointError, match="does not exist"):
        offload.load(opt, tmp_path / "nothing")


@pytest.mark.timeout(30)
def test_async_save_blocks_next_step_until_written(tmp_path):
    model, opt = make()
    train(model, opt, 2, 0)
    snapshot = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt.state_dict()["state"].items()}
    handle = offload.save_async(opt, tmp_path, chunk_bytes=4096)
    train(model, opt, 2, 2)  # the first step waits for the save through the pre-hook
    assert handle.done() and handle.result() == str(tmp_path)
    _, opt2 = make()
    offload.load(opt2, tmp_path)
    for k, v in opt2.state_dict()["state"].items():
        for kk, vv in v.items():
            assert torch.equal(vv, snapshot[k][kk]), (k, kk)

    async def main():
        return await offload.save_async(opt, tmp_path / "aio")
    assert asyncio.run(main()) == str(tmp_path / "aio")
    _, opt3 = make()
    offload.load(opt3, tmp_path / "aio")
    state_equal(opt, opt3)


CHILD = textwrap.dedent("""
    import sys, torch, offload
    d = sys.argv[1]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (600_000, 400_000, 7)]
    opt = offload.AdamW(params, amsgrad=True)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    v = 0
    while True:
        v += 1
        for p in params:  # a consistent state: every element and every step count equals v
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                opt.state[p][key].fill_(v)
            opt.state[p]["step"].fill_(v)
        offload.save(opt, d, chunk_bytes=1 << 16)
        print(v, flush=True)
""")


@pytest.mark.timeout(60)
def test_sigkill_mid_save_leaves_a_loadable_consistent_checkpoint(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rng = random.Random(5)
    for trial in range(3):
        d = tmp_path / f"ck{trial}"
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(d)], stdout=subprocess.PIPE, env=env, text=True)
        try:
            first = proc.stdout.readline()  # one complete checkpoint exists
            assert first.strip() == "1", first
            t0 = time.monotonic()
            second = proc.stdout.readline()  # time one save to spread the kill points over it
            period = time.monotonic() - t0
            time.sleep(rng.uniform(0, 2 * period))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        done = int(second) if second.strip() else 1
        params = [torch.nn.Parameter(torch.zeros(n)) for n in (600_000, 400_000, 7)]
        opt = offload.AdamW(params, amsgrad=True)
        offload.load(opt, d)
        v = opt.state[params[0]]["step"].item()
        assert done <= v <= done + 5  # the last committed generation, never an older one
        for p in params:
            assert opt.state[p]["step"].item() == v
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                t = opt.state[p][key]
                assert torch.equal(t, torch.full_like(t, v)), (trial, key)
        leftovers = [f for f in os.listdir(d) if f.endswith(".safetensors")]
        assert 1 <= len(leftovers) <= 2
        offload.save(opt, d)  # the next save removes what the killed one left behind
        assert len(os.listdir(d)) == 3 and not any(".tmp-" in f for f in os.listdir(d))


@pytest.mark.timeout(30)
def test_progress_bar(tmp_path, capsys):
    pytest.importorskip("tqdm")
    model, opt = make()
    train(model, opt, 1, 0)
    offload.save(opt, tmp_path, progress=True, chunk_bytes=4096)
    assert "offload.save rank 0" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_load_replaces_state_keys_and_hyperparameters(tmp_path):
    model, opt = make(amsgrad=False)
    train(model, opt, 2, 0)
    offload.save(opt, tmp_path)
    model2, opt2 = make(amsgrad=True)
    train(model2, opt2, 1, 0)  # has max_exp_avg_sq and step 1
    model2.load_state_dict(model.state_dict())
    offload.load(opt2, tmp_path)
    assert opt2.param_groups[0]["amsgrad"] is False
    state_equal(opt, opt2)
    train(model, opt, 2, 2)
    train(model2, opt2, 2, 2)
    state_equal(opt, opt2)


@pytest.mark.timeout(30)
def test_load_never_unpickles(tmp_path, monkeypatch):
    import pickle

    model, opt = make()
    train(model, opt, 1, 0)
    offload.save(opt, tmp_path)

    def refuse(*a, **k):
        raise AssertionError("offload.load must not unpickle")
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    _, opt2 = make()
    offload.load(opt2, tmp_path)
    state_equal(opt, opt2)


def _mode_kwargs(mode, tmp_path):
    if mode == "gpu-fake":  # GPU-offload engine driven on the CPU (offload/device.py)
        from offload.device import CpuDevice
        return {"offload_device": CpuDevice()}
    os.makedirs(tmp_path, exist_ok=True)
    return {"state": mode, "nvme_dir": str(tmp_path), "host_budget": 16384}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["nvme", "mmap", "gpu-fake"])
def test_resume_with_nvme_state_or_gpu_engine(tmp_path, mode):
    def build(seed=0):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        model[2].to(torch.bfloat16)
        opt = offload.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-3}],
                            lr=1e-2, **_mode_kwargs(mode, tmp_path / f"s{seed}"))
        return model, opt

    def run(model, opt, steps, start):
        for s in range(start, start + steps):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1000 + s))
            model[2](model[1](model[0](x)).to(torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    ref_model, ref_opt = build(seed=0)
    run(ref_model, ref_opt, 6, 0)
    model, opt = build(seed=0)
    run(model, opt, 3, 0)
    offload.save(opt, tmp_path / "ck")
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    model2, opt2 = build(seed=7)
    model2.load_state_dict(weights)
    offload.load(opt2, tmp_path / "ck")
    state_equal(opt, opt2)
    run(model2, opt2, 3, 3)
    for o in (ref_opt, opt2):
        if hasattr(o, "synchronize"):
            o.synchronize()  # GPU mode: new weights go up asynchronously
    for a, b in zip(ref_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    state_equal(ref_opt, opt2)
    if mode == "gpu-fake":
        with pytest.raises(NotImplementedError, match="save_async with GPU offload"):
            offload.save_async(opt2, tmp_path / "ck2")
    for o in (ref_opt, opt, opt2):
        o.close()
