"""test_store_files.py: the state files of the NVMe and mmap tiers: private, preallocated and removed,
constructor validation, a planted symlink, a full or read-only filesystem, a forked child that must not
use or delete its parent's state, and the leftovers of killed runs (reported and removed)."""
import errno
import gc
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

import offload
from offload.testing import state_dir, state_file, tier
from offload import store as store_mod
from offload.state import statedir
from offload.store import parse_size
from conftest import configs
from store_util import _run_script, make_opt, make_params, run_steps


# ---------------------------------------------------------------------------------- files
@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", configs(sides=("host",), tiers=("nvme", "mmap"), moments=("fp32",)))
def test_file_private_preallocated_and_removed(tmp_path, cfg):
    ps = make_params()
    opt = make_opt(ps, storage=cfg.tier, nvme_dir=tmp_path, host_budget=32768)
    st = tier(opt)
    d = st.directory
    assert os.path.dirname(d) == str(tmp_path)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(st.path).st_mode) == 0o600
    assert os.stat(st.path).st_size == st.file_bytes
    assert os.stat(st.path).st_blocks * 512 >= st.file_bytes  # reserved, not sparse
    other = make_opt(make_params(), storage=cfg.tier, nvme_dir=tmp_path, host_budget=32768)
    assert state_dir(other) != d  # every optimizer gets a new directory
    opt.close()
    assert not os.path.exists(d)
    with pytest.raises(RuntimeError, match="closed"):
        run_steps(ps, opt, 1)
    d2 = state_dir(other)
    del other
    gc.collect()
    assert not os.path.exists(d2)  # removed on garbage collection too
    kept = make_opt(make_params(), storage=cfg.tier, nvme_dir=tmp_path, keep_files=True)
    path = state_file(kept)
    kept.close()
    assert os.path.exists(path)


@pytest.mark.timeout(30)
def test_storage_errors_name_what_is_wrong(tmp_path):
    """Each bad storage argument is named as the user wrote it: nvme_dir (which entry, its type),
    storage (not its old name), and of nvme_dir / nvme_options the one given with storage='ram'."""
    ps, d = make_params(), str(tmp_path)
    path = "must be a directory path"
    cases = [(dict(nvme_dir=""), ValueError, r"nvme_dir='' names an empty path"),
             (dict(nvme_dir=[]), ValueError, r"nvme_dir=\[\] is empty"),
             (dict(nvme_dir=[d, ""]), ValueError, r"nvme_dir=\[.*''\] names an empty path"),
             (dict(nvme_dir=5), TypeError, rf"nvme_dir {path} .* got int"),
             (dict(nvme_dir=[d, 5]), TypeError, rf"nvme_dir\[1\] {path} .* got int"),
             (dict(nvme_dir={d}), TypeError, rf"nvme_dir {path} .* got set"),
             (dict(storage="mmap", nvme_dir=[d, 5]), TypeError, r"nvme_dir\[1\]"),
             (dict(storage="ram", nvme_dir=d), ValueError, r"^nvme_dir only applies to storage="),
             (dict(storage="ram", nvme_options={"depth": 3}), ValueError, r"^nvme_options only"),
             (dict(storage="disk"), ValueError, r"^storage must be 'ram', 'nvme' or 'mmap'")]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            make_opt(ps, **kw)
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(30)
def test_constructor_validation(tmp_path):
    ps = make_params()
    with pytest.raises(ValueError, match="storage must be 'ram', 'nvme' or 'mmap', got 'disk'"):
        make_opt(ps, storage="disk")
    with pytest.raises(ValueError, match="needs nvme_dir"):
        make_opt(ps, storage="nvme")
    with pytest.raises(ValueError, match="nvme_dir only applies"):
        make_opt(ps, storage="ram", nvme_dir=tmp_path)
    with pytest.raises(FileNotFoundError):
        make_opt(ps, storage="nvme", nvme_dir=tmp_path / "missing")
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        make_opt(ps, storage="nvme", nvme_dir=tmp_path / "afile")
    with pytest.raises(ValueError, match="too small"):
        make_opt(ps, storage="nvme", nvme_dir=tmp_path, host_budget=4096)
    with pytest.raises(ValueError, match="cannot parse"):
        make_opt(ps, storage="nvme", nvme_dir=tmp_path, host_budget="lots")
    assert os.listdir(tmp_path) == ["afile"]  # failed constructions leave nothing behind
    opt = make_opt(ps, nvme_dir=tmp_path)   # nvme_dir alone: storage="nvme"
    opt.add_param_group({"params": [torch.zeros(3)]})  # NVMe state grows (tests/test_matrix.py checks the math)
    assert len(opt.param_groups) == 4 and opt.storage_info()["mode"] == "nvme"  # make_params: three groups
    with pytest.raises(TypeError, match="pickled"):
        import copy
        copy.deepcopy(opt)
    assert parse_size("2GiB") == 2 << 30 and parse_size("512MB") == 512 * 10**6 and parse_size("64M") == 64 << 20
    assert parse_size(4096) == 4096


@pytest.mark.timeout(30)
def test_symlink_planted_where_state_file_goes(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    from offload.state import files as files_mod
    real = files_mod.make_private_dir

    def planted(parent):
        d = real(parent)
        os.symlink(victim, os.path.join(d, files_mod.STATE_FILE))
        return d

    monkeypatch.setattr(files_mod, "make_private_dir", planted)
    with pytest.raises(FileExistsError):
        make_opt(make_params(), storage="nvme", nvme_dir=tmp_path)
    gc.collect()
    assert victim.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == ["victim"]


def _mount_tmpfs(path, opts):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "size=1M")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def readonly_fs(tmp_path):
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "ro,size=1M")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cfg", configs(sides=("host",), tiers=("nvme", "mmap"), moments=("fp32",)))
def test_full_disk_fails_at_construction(small_fs, cfg):
    ps = [torch.zeros(1 << 20)]  # 8 MiB of state on a 1 MiB filesystem
    with pytest.raises(OSError, match="not enough space") as ei:
        offload.AdamW(ps, storage=cfg.tier, nvme_dir=small_fs)
    assert ei.value.errno == errno.ENOSPC
    gc.collect()
    assert os.listdir(small_fs) == []


@pytest.mark.timeout(30)
def test_unwritable_directory(readonly_fs):
    with pytest.raises(OSError, match="cannot create the optimizer state directory") as ei:
        offload.AdamW([torch.zeros(10)], storage="nvme", nvme_dir=readonly_fs)
    assert ei.value.errno == errno.EROFS


# ---------------------------------------------------------------------------------- fork (item 13)
FORK_SCRIPT = """
    import gc, json, os, sys, time, torch, offload, offload.testing
    d = sys.argv[1]

    def wait(pid, limit):
        t = time.time()
        while time.time() - t < limit:
            r, status = os.waitpid(pid, os.WNOHANG)
            if r:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return "hang"

    result = {}
    for mode in ("mmap", "nvme"):
        ps = [torch.randn(1000), torch.randn(500).bfloat16()]
        opt = offload.AdamW(ps, storage=mode, nvme_dir=d, host_budget=4 * 8192)
        for p in ps:
            p.grad = torch.ones(p.shape, dtype=p.dtype)
        opt.step()
        state_dir = offload.testing.state_dir(opt)
        before = {k: {kk: v.clone() for kk, v in st.items()} for k, st in opt.state_dict()["state"].items()}
        params = [p.clone() for p in ps]
        out = result[mode] = {}
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                         # child 1: uses the optimizer, then drops it
            msgs = []
            for call in (opt.step, opt.state_dict):
                try:
                    call()
                    msgs.append("no error")
                except RuntimeError as e:
                    msgs.append(str(e))
            if mode == "mmap":               # its finalizer runs in the child (nvme: see the native engine)
                del opt
                gc.collect()
            os.write(w, json.dumps(msgs).encode())
            os._exit(0)
        os.close(w)
        out["child1"] = wait(pid, 20)
        out["msgs"] = json.loads(os.read(r, 65536).decode() or "[]")
        os.close(r)
        gc.freeze()                          # the child's interpreter shutdown then copies fewer pages
        pid = os.fork()
        if pid == 0:                         # child 2: just exits (atexit finalizers run in the child)
            sys.exit(0)
        out["child2"] = wait(pid, 30 if mode == "mmap" else 8)  # nvme: may hang in the engine destructor
        gc.unfreeze()
        out["dir_kept"] = os.path.isdir(state_dir)
        sd = opt.state_dict()
        out["state_unchanged"] = all(torch.equal(v, before[k][kk])
                                     for k, st in sd["state"].items() for kk, v in st.items())
        out["params_unchanged"] = all(torch.equal(a, b) for a, b in zip(ps, params))
        del sd
        opt.step()                           # the parent goes on
        opt.close()
        out["removed_by_parent"] = not os.path.exists(state_dir)
        out["parent_pid"] = os.getpid()
    print(json.dumps(result))
"""


@pytest.mark.timeout(90)
def test_fork_child_cannot_use_or_delete_the_parents_state(tmp_path):
    import json
    r = _run_script(FORK_SCRIPT, tmp_path, timeout=80)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    for mode, out in result.items():
        assert out["child1"] == 0, (mode, out)
        assert len(out["msgs"]) == 2
        for m in out["msgs"]:
            assert f"optimizer state of process {out['parent_pid']} cannot be used after fork" in m, (mode, m)
            assert "Create the optimizer in the child" in m
        assert out["dir_kept"] and out["state_unchanged"] and out["params_unchanged"], (mode, out)
        assert out["removed_by_parent"], (mode, out)
    assert result["mmap"]["child2"] == 0, result
    if result["nvme"]["child2"] != 0:
        pytest.xfail(f"native helper: aio fork (a child's sys.exit in the AioEngine destructor: "
                     f"{result['nvme']['child2']})")


# ---------------------------------------------------------------------------------- leftovers (item 19)
KILLED_SCRIPT = """
    import sys, time, torch, offload, offload.testing
    opts = [offload.AdamW([torch.zeros(300000)], storage=m, nvme_dir=sys.argv[1]) for m in ("nvme", "mmap")]
    print(" ".join(offload.testing.state_dir(o) for o in opts), flush=True)
    time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_leftovers_of_killed_runs_reported_and_removed(tmp_path):
    import json
    import signal
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    live = offload.AdamW([torch.zeros(10)], storage="nvme", nvme_dir=tmp_path)
    live_dir = state_dir(live)                                          # a live process's state (ours)
    kept = offload.AdamW([torch.zeros(10)], storage="mmap", nvme_dir=tmp_path, keep_files=True)
    kept_dir = state_dir(kept)
    kept.close()                                                        # kept on purpose: not a leftover
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_SCRIPT), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, env=env)
    dead = proc.stdout.readline().split()
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert len(dead) == 2
    assert all(os.path.isdir(d) for d in dead)
    # decoys that must never be reported or removed
    (tmp_path / "offload-state-user0001").mkdir()                      # the name alone: no marker
    (tmp_path / "offload-state-user0001" / "notes.txt").write_text("mine")
    (tmp_path / "offload-state-file0001").write_text("a file")
    (tmp_path / "ranking.csv").write_text("1,2")
    # a dead owner's directory that a user put a file into: reported, but left alone
    extra = dead[1]
    (tmp_path / os.path.basename(extra) / "user.txt").write_text("mine too")
    # pid reuse: the marker names a running process (this one) but another start time
    reused = tmp_path / "offload-state-reused01"
    reused.mkdir(mode=0o700)
    statedir.write_marker(str(reused))   # this process's identity, then another start time
    m = json.loads((reused / statedir.MARKER).read_text())
    m.update(start_ticks=m["start_ticks"] - 1, created="x", kept=False)
    (reused / statedir.MARKER).write_text(json.dumps(m))
    (reused / statedir.STATE_FILE).write_bytes(b"\0" * 8192)

    with pytest.warns(RuntimeWarning, match="processes that no longer run") as rec:
        opt = offload.AdamW([torch.zeros(10)], storage="nvme", nvme_dir=tmp_path)
    msg = str(rec[0].message)
    assert dead[0] in msg and extra in msg and str(reused) in msg and "2.3 MiB" in msg  # 300000 * 8 B, 4 KiB pages
    assert f"offload.store.remove_stale_state({str(tmp_path)!r})" in msg
    for d in ("offload-state-user0001", live_dir, kept_dir, state_dir(opt)):
        assert os.path.basename(d) not in msg
    assert sorted(s.path for s in store_mod.find_stale_state(tmp_path)) == sorted([dead[0], extra, str(reused)])

    removed = store_mod.remove_stale_state(tmp_path)
    assert sorted(removed) == sorted([dead[0], str(reused)])
    assert not os.path.exists(dead[0]) and not reused.exists()
    assert sorted(os.listdir(extra)) == sorted([statedir.MARKER, statedir.STATE_FILE, "user.txt"])
    assert (tmp_path / "offload-state-user0001" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "offload-state-file0001").read_text() == "a file"
    assert (tmp_path / "ranking.csv").exists()
    assert os.path.isdir(live_dir) and os.path.isdir(kept_dir) and os.path.isdir(state_dir(opt))
    live.close()
    opt.close()
    assert not os.path.exists(live_dir)
