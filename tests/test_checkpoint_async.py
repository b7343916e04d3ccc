"""test_checkpoint_async.py: asynchronous and interrupted saves: save_async blocks the next step until
written, a save killed (SIGKILL) at any point leaves the last committed checkpoint whole, save_async as
a script's last line is committed at exit, failed asynchronous saves are reported once, a pending save
keeps no optimizer alive, interleaved saves into one directory leave one generation."""
import asyncio
import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import weakref

import pytest
import torch

import offload
from checkpoint_util import ENV, ROOT, make, state_equal, train


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
