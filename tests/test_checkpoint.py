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


def test_save_killed_between_commit_and_cleanup_leaves_nothing_behind(tmp_path, monkeypatch):
    """A kill right after index.json is committed, before the superseded generation is deleted:
    the next save must still remove that generation (its manifest names what it supersedes)."""
    import importlib
    save_mod = importlib.import_module("offload.checkpoint.save")
    model, opt = make()
    train(model, opt, 1, 0)
    offload.save(opt, tmp_path)                                   # generation A, committed
    with monkeypatch.context() as mp:
        mp.setattr(save_mod.Saver, "cleanup", lambda self: None)  # generation B: "killed" after its commit
        offload.save(opt, tmp_path)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) == 2
    offload.save(opt, tmp_path)                                   # generation C removes A and B
    names = os.listdir(tmp_path)
    assert len(names) == 3 and sum(f.endswith(".safetensors") for f in names) == 1, names


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
    return {"storage": mode, "nvme_dir": str(tmp_path), "host_budget": 16384}


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


# ====================================================================== issue 10, items 12, 15-18
import copy  # noqa: E402
import gc  # noqa: E402
import threading  # noqa: E402
import weakref  # noqa: E402
import zlib  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def snapshot(opt):
    sd = opt.state_dict()
    state = {k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else copy.deepcopy(vv)) for kk, vv in v.items()}
             for k, v in sd["state"].items()}
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    return state, copy.deepcopy(sd["param_groups"]), params, getattr(opt, "pending_grad_multiplier", None)


def assert_unchanged(before, opt):
    after = snapshot(opt)
    sa, sb = before[0], after[0]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys(), k
        for kk in sa[k]:
            a, b = sa[k][kk], sb[k][kk]
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (k, kk)
            else:
                assert a == b, (k, kk)
    assert repr(before[1]) == repr(after[1])
    for a, b in zip(before[2], after[2]):
        assert torch.equal(a, b)
    assert before[3] == after[3]


def rewrite_rank_index(d, mutate):
    """Edit the rank index and re-seal it (fix its crc in index.json): only validation can refuse it."""
    index = json.loads((d / "index.json").read_text())
    name = index["ranks"][0]["index"]
    ridx = json.loads((d / name).read_text())
    mutate(ridx)
    raw = json.dumps(ridx, indent=1).encode()
    (d / name).write_bytes(raw)
    index["ranks"][0]["index_crc32"] = zlib.crc32(raw)
    (d / "index.json").write_text(json.dumps(index, indent=1))


def rewrite_header(d, old, new):
    """Replace text in the safetensors header, keeping its length (padding with spaces)."""
    path = data_file(d)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        head = f.read(n).decode()
        assert old in head
        head2 = head.replace(old, new)
        head2 = head2.rstrip() + " " * (n - len(head2.rstrip()))
        assert len(head2) == n
        f.seek(8)
        f.write(head2.encode())


def _saved(tmp_path, mode="ram"):
    model, opt = make()
    train(model, opt, 2, 0)
    offload.save(opt, tmp_path)
    model2, opt2 = make(seed=3)
    if mode != "ram":  # the same optimizer with its state in an NVMe/mmap store
        opt2 = offload.AdamW([{"params": model2[0].parameters()}, {"params": model2[2].parameters(), "lr": 3e-3}],
                             lr=1e-2, amsgrad=True, **_mode_kwargs(mode, str(tmp_path) + "-state"))
    train(model2, opt2, 1, 0)
    return opt, opt2


# ---------------------------------------------------------------------- 12: save_async
EXIT_CHILD = textwrap.dedent("""
    import os, sys, torch, offload
    d, mode = sys.argv[1], sys.argv[2]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300_000, 200_000, 7)]
    opt = offload.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            opt.state[p][key].fill_(3.0)
    if mode == "fail":
        offload.save(opt, d)          # a committed checkpoint with the same values
        for p in params:
            opt.state[p]["exp_avg"].fill_(4.0)
        def full(fd):
            raise OSError(28, "No space left on device")
        os.fsync = full
    offload.save_async(opt, d, chunk_bytes=4096)   # the last line of the script
""")


@pytest.mark.timeout(60)
def test_save_async_as_last_line_is_committed_at_exit(tmp_path):
    for trial in range(1):
        d = tmp_path / f"ck{trial}"
        r = subprocess.run([sys.executable, "-c", EXIT_CHILD, str(d), "ok"], env=ENV, capture_output=True,
                           text=True, timeout=50)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
        params = [torch.nn.Parameter(torch.zeros(n)) for n in (300_000, 200_000, 7)]
        opt = offload.AdamW(params)
        offload.load(opt, d)
        for p in params:
            assert opt.state[p]["step"].item() == 1
            assert torch.equal(opt.state[p]["exp_avg"], torch.full_like(p, 3.0))
        assert sorted(os.listdir(d))[0] == "index.json" and len(os.listdir(d)) == 3


@pytest.mark.timeout(60)
def test_failed_save_async_at_exit_is_reported_and_old_checkpoint_kept(tmp_path):
    r = subprocess.run([sys.executable, "-c", EXIT_CHILD, str(tmp_path), "fail"], env=ENV, capture_output=True,
                       text=True, timeout=50)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "save_async into" in r.stderr and "No space left on device" in r.stderr and "NOT committed" in r.stderr
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300_000, 200_000, 7)]
    opt = offload.AdamW(params)
    offload.load(opt, tmp_path)
    for p in params:
        assert torch.equal(opt.state[p]["exp_avg"], torch.full_like(p, 3.0))
    assert len(os.listdir(tmp_path)) == 3  # the failed save removed what it had written


@pytest.mark.timeout(30)
def test_failed_save_async_raises_once_then_training_goes_on(tmp_path, monkeypatch):
    model, opt = make()
    train(model, opt, 1, 0)

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    handle = offload.save_async(opt, tmp_path / "full")
    while not handle.done():
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(OSError, match="No space left"):
        train(model, opt, 1, 1)  # the next step reports the failure once
    train(model, opt, 2, 2)  # ... and then training goes on
    offload.save(opt, tmp_path / "ok")
    offload.save_async(opt, tmp_path / "ok2").result()
    with pytest.raises(OSError, match="No space left"):
        handle.result()  # the handle itself always tells the truth
    assert [f for f in os.listdir(tmp_path / "full") if not f.startswith("index")] == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["ram", "nvme"])
def test_pending_save_does_not_keep_the_optimizer_alive(tmp_path, mode):
    kw = {} if mode == "ram" else {"storage": "nvme", "nvme_dir": str(tmp_path / "nv"), "host_budget": 16384}
    os.makedirs(tmp_path / "nv", exist_ok=True)
    params = [torch.nn.Parameter(torch.randn(50_000)) for _ in range(3)]
    opt = offload.AdamW(params, **kw)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    ref = weakref.ref(opt)
    handle = offload.save_async(opt, tmp_path / "ck", chunk_bytes=4096)
    del opt
    assert handle.result() == str(tmp_path / "ck")
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())
    assert os.listdir(tmp_path / "nv") == []  # the NVMe state (and its buffers) went with it
    opt2 = offload.AdamW(params)
    offload.load(opt2, tmp_path / "ck")


# ---------------------------------------------------------------------- 15: user files
USER_FILES = ["ranking.csv", "rank_notes.txt", ".ranked", "rank00000-of-00001.0123456789abcdef.json",
              "rank00000-of-00001.0123456789abcdef.safetensors", "rank00001-of-00002.0123456789abcde.json",
              ".rank00000-of-00001.0123456789abcdef.safetensors.tmp-12-abcdef12", ".index.json.tmp-99-deadbeef",
              ".rank00000-of-00001.0123456789abcdef.intent", "rank00000-of-00001.json.bak", "index.json.orig",
              "rank00000-of-00001.safetensors"]


@pytest.mark.timeout(30)
def test_save_never_deletes_files_it_did_not_create(tmp_path):
    for name in USER_FILES:
        (tmp_path / name).write_text(f"user data {name}")
    model, opt = make()
    for s in range(3):
        train(model, opt, 1, s)
        offload.save(opt, tmp_path)
        offload.save_async(opt, tmp_path).result()
    for name in USER_FILES:
        assert (tmp_path / name).read_text() == f"user data {name}", name
    assert len(os.listdir(tmp_path)) == len(USER_FILES) + 3
    _, opt2 = make()
    offload.load(opt2, tmp_path)
    state_equal(opt, opt2)


@pytest.mark.timeout(30)
def test_save_refuses_to_overwrite_a_foreign_index_json(tmp_path):
    (tmp_path / "index.json").write_text('{"my": "dataset index"}')
    model, opt = make()
    train(model, opt, 1, 0)
    with pytest.raises(CheckpointError, match="not an offload checkpoint index.*refusing to overwrite"):
        offload.save(opt, tmp_path)
    assert os.listdir(tmp_path) == ["index.json"]
    assert (tmp_path / "index.json").read_text() == '{"my": "dataset index"}'


# ---------------------------------------------------------------------- 16: names and symlinks
@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["../outside.json", "/etc/passwd", "sub/x.json", "a\u0000b", "..",
                                 "rank00000-of-00001.0123456789abcdef.json"])
def test_index_names_outside_the_directory_are_refused(tmp_path, bad):
    d = tmp_path / "ck"
    opt, opt2 = _saved(d)
    index = json.loads((d / "index.json").read_text())
    real = index["ranks"][0]["index"]
    (tmp_path / "outside.json").write_bytes((d / real).read_bytes())  # a valid rank index outside
    index["ranks"][0]["index"] = bad
    (d / "index.json").write_text(json.dumps(index))
    before = snapshot(opt2)
    with pytest.raises(CheckpointError, match="refusing to follow"):
        offload.load(opt2, d)
    assert_unchanged(before, opt2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("which", ["json", "safetensors"])
def test_symlinked_checkpoint_files_are_refused(tmp_path, which):
    d = tmp_path / "ck"
    opt, opt2 = _saved(d)
    name = next(f for f in os.listdir(d) if f.startswith("rank") and f.endswith(which))
    os.rename(d / name, tmp_path / name)
    os.symlink(tmp_path / name, d / name)
    before = snapshot(opt2)
    with pytest.raises(CheckpointError, match="symbolic link"):
        offload.load(opt2, d)
    assert_unchanged(before, opt2)


# ---------------------------------------------------------------------- 17: malformed rank index
def _t(r, key="exp_avg", param=0):
    return next(t for t in r["tensors"] if t["key"] == key and t["param"] == param)


MALFORMED = {
    "param -1": lambda r: _t(r).update(param=-1, name="state.-1.exp_avg"),
    "param 99": lambda r: _t(r).update(param=99, name="state.99.exp_avg"),
    "param bool": lambda r: _t(r).update(param=True),
    "lr tensor abc": lambda r: r["param_groups"][0]["hyper"].update(lr={"__tensor__": "abc"}),
    "lr string": lambda r: r["param_groups"][0]["hyper"].update(lr="abc"),
    "lr list": lambda r: r["param_groups"][1]["hyper"].update(lr=[1, 2]),
    "betas short": lambda r: r["param_groups"][0]["hyper"].update(betas={"__tuple__": [0.9]}),
    "amsgrad int": lambda r: r["param_groups"][0]["hyper"].update(amsgrad=3),
    "params key": lambda r: r["param_groups"][0]["hyper"].update(params=[0]),
    "param_names key": lambda r: r["param_groups"][0]["hyper"].update(param_names=["x"]),
    "group params shifted": lambda r: r["param_groups"][1].update(params=[1, 2]),
    "shape 2**40": lambda r: _t(r).update(shape=[2 ** 40]),
    "shape negative": lambda r: _t(r).update(shape=[-16, -8]),
    "dtype F16": lambda r: _t(r).update(dtype="F16"),
    "dtype unknown": lambda r: _t(r).update(dtype="X99"),
    "offset past end": lambda r: _t(r).update(offsets=[10 ** 9, 10 ** 9 + 512]),
    "offset negative": lambda r: _t(r).update(offsets=[-512, 0]),
    "crc string": lambda r: _t(r).update(crc32="0"),
    "step string": lambda r: r["params"][0].update(step="7"),
    "step negative": lambda r: r["params"][0].update(step=-1),
    "step inf": lambda r: r["params"][0].update(step=float("inf")),
    "has_state string": lambda r: r["params"][0].update(has_state="yes"),
    "no state but tensors": lambda r: r["params"][0].update(has_state=False, step=None),
    "extra step": lambda r: r["params"][0]["extra"].update(step=1),
    "extra nested": lambda r: r["params"][0]["extra"].update(x=json.loads("[" * 60 + "]" * 60)),
    "tensors dict": lambda r: r.update(tensors={}),
    "groups missing": lambda r: r.pop("param_groups"),
    "params not list": lambda r: r.update(params=None),
    "name mismatch": lambda r: _t(r).update(name="state.1.exp_avg"),
    "duplicate tensor": lambda r: r["tensors"].append(dict(_t(r))),
    "multiplier string": lambda r: r.update(pending_grad_multiplier="x"),
    "world_size": lambda r: r.update(world_size=2),
    "data_bytes": lambda r: r.update(data_bytes=r["data_bytes"] + 1),
    "header_bytes": lambda r: r.update(header_bytes=10 ** 12),
    "wrong class": lambda r: r.update(optimizer="SGD", optimizer_kind="SGD"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["ram", "nvme"])
def test_malformed_rank_index_never_changes_the_optimizer(tmp_path, mode):
    d = tmp_path / "ck"
    opt, opt2 = _saved(d, mode)
    pristine = {n: (d / n).read_bytes() for n in os.listdir(d)}
    for case, mutate in MALFORMED.items():
        for n, b in pristine.items():
            (d / n).write_bytes(b)
        rewrite_rank_index(d, mutate)
        before = snapshot(opt2)
        with pytest.raises(CheckpointError):
            offload.load(opt2, d)
        assert_unchanged(before, opt2)
    for n, b in pristine.items():
        (d / n).write_bytes(b)
    offload.load(opt2, d)
    state_equal(opt, opt2)


@pytest.mark.timeout(30)
def test_state_tensor_shape_must_match_its_parameter(tmp_path):
    # transposed state, consistent everywhere (rank index, header, byte count): loads into a
    # (16, 8) parameter only if shapes are checked against the parameters
    d = tmp_path / "ck"
    _, opt2 = _saved(d)
    rewrite_rank_index(d, lambda r: _t(r).update(shape=[8, 16]))
    entry = '"state.0.exp_avg":{"dtype":"F32","shape":'
    rewrite_header(d, entry + "[16,8]", entry + "[8,16]")
    before = snapshot(opt2)
    with pytest.raises(CheckpointError, match=r"state.0.exp_avg.*shape \(8, 16\).*\(16, 8\)"):
        offload.load(opt2, d)
    assert_unchanged(before, opt2)


# ---------------------------------------------------------------------- 18: JSON, FIFO, class, dtypes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["index", "rank"])
def test_single_bit_flips_give_checkpoint_error_or_the_right_state(tmp_path, target):
    d = tmp_path / "ck"
    opt, opt2 = _saved(d)
    pristine = {n: (d / n).read_bytes() for n in os.listdir(d)}
    index = json.loads(pristine["index.json"])
    name = "index.json" if target == "index" else index["ranks"][0]["index"]
    raw = pristine[name]
    rng = random.Random(10 if target == "index" else 11)
    loaded = 0
    for _ in range(100):
        for n, b in pristine.items():
            (d / n).write_bytes(b)
        bit = rng.randrange(len(raw) * 8)
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        (d / name).write_bytes(bytes(flipped))
        if target == "rank":  # re-seal: only the validation stands between the flip and the optimizer
            index2 = dict(index, ranks=[dict(index["ranks"][0], index_crc32=zlib.crc32(bytes(flipped)))])
            (d / "index.json").write_text(json.dumps(index2))
        before = snapshot(opt2)
        try:
            offload.load(opt2, d)
        except CheckpointError:
            assert_unchanged(before, opt2)
            continue
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"bit {bit}: {type(e).__name__}: {e}")
        loaded += 1
        if target == "index":  # index.json carries no state: a flip that loads loaded the real thing
            state_equal(opt, opt2)
        _, opt2 = make(seed=3)  # a flip that still loads must not have loaded anything else
        train(make(seed=3)[0], opt2, 1, 0)
    assert loaded < 100


@pytest.mark.timeout(30)
def test_fifo_named_index_json_does_not_block(tmp_path):
    d = tmp_path / "ck"
    os.makedirs(d)
    os.mkfifo(d / "index.json")
    _, opt = make()
    out = []

    def run():
        try:
            offload.load(opt, d)
        except BaseException as e:  # noqa: BLE001
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the reader so that the test run can end
        fd = os.open(d / "index.json", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("offload.load blocked on a FIFO named index.json")
    assert isinstance(out[0], CheckpointError) and "not a regular file" in str(out[0])


@pytest.mark.timeout(30)
def test_optimizer_class_is_checked(tmp_path):
    model, opt = make()
    train(model, opt, 1, 0)
    offload.save(opt, tmp_path)
    for other in (torch.optim.SGD(model.parameters(), lr=0.1), offload.Adam(model.parameters()),
                  torch.optim.Adam(model.parameters())):
        groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]
        other = type(other)(groups, lr=0.1)
        before = snapshot(other)
        with pytest.raises(CheckpointError, match="saved from a AdamW optimizer.*different things"):
            offload.load(other, tmp_path)
        assert_unchanged(before, other)
    # the same family across implementations is allowed: torch.optim.AdamW <-> offload.AdamW
    lin = torch.nn.Linear(4, 3)
    t_opt = torch.optim.AdamW(lin.parameters(), lr=0.01)
    lin(torch.randn(2, 4)).sum().backward()
    t_opt.step()
    offload.save(t_opt, tmp_path / "t")
    o_opt = offload.AdamW(lin.parameters(), lr=0.5)
    offload.load(o_opt, tmp_path / "t")
    assert o_opt.param_groups[0]["lr"] == 0.01
    state_equal(t_opt, o_opt)


@pytest.mark.timeout(30)
def test_complex_and_float64_state_round_trip(tmp_path):
    from safetensors import safe_open

    def build():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(5, 3, dtype=dt)) for dt in
              (torch.complex64, torch.complex128, torch.float64)]
        return ps, torch.optim.AdamW(ps, lr=0.01, amsgrad=True)

    def run(ps, opt, steps):
        for s in range(steps):
            g = torch.Generator().manual_seed(s)
            for p in ps:
                p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)
            opt.step()

    ps, opt = build()
    run(ps, opt, 2)
    offload.save(opt, tmp_path)
    with safe_open(data_file(tmp_path), "pt") as f:
        c128 = f.get_tensor("state.1.exp_avg")  # no safetensors tag for complex128: its real view
        assert c128.dtype == torch.float64 and torch.equal(torch.view_as_complex(c128), opt.state[ps[1]]["exp_avg"])
        assert torch.equal(f.get_tensor("state.0.exp_avg"), opt.state[ps[0]]["exp_avg"])  # C64
        assert torch.equal(f.get_tensor("state.2.max_exp_avg_sq"), opt.state[ps[2]]["max_exp_avg_sq"])
    ps2, opt2 = build()
    with torch.no_grad():
        for a, b in zip(ps2, ps):
            a.copy_(b)
    offload.load(opt2, tmp_path)
    state_equal(opt, opt2)
    run(ps, opt, 1)
    run(ps2, opt2, 1)
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)


@pytest.mark.timeout(30)
def test_interleaved_saves_into_one_directory_leave_one_generation(tmp_path):
    model, opt = make()
    train(model, opt, 1, 0)
    _, other = make(seed=1)
    train(model, other, 1, 0)
    a = offload.save_async(opt, tmp_path, chunk_bytes=4096)
    offload.save(other, tmp_path)  # constructed while a is pending, written after it
    a.result()
    assert len(os.listdir(tmp_path)) == 3
    _, fresh = make()
    offload.load(fresh, tmp_path)
    state_equal(other, fresh)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", ["[" * 100_000, '{"format": "offload-checkpoint", "version": 1}', "\xff\xfe",
                                  '{"format": "offload-checkpoint", "version": 1, "world_size": 1, "generation": '
                                  '"0123456789abcdef", "ranks": [7]}', "1e999999", "9" * 5000, "null", ""])
def test_malformed_index_json_is_a_checkpoint_error(tmp_path, text):
    d = tmp_path / "ck"
    _, opt2 = _saved(d)
    (d / "index.json").write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff\xfe" else b"\xff\xfe")
    before = snapshot(opt2)
    with pytest.raises(CheckpointError):
        offload.load(opt2, d)
    assert_unchanged(before, opt2)
