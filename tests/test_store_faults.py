"""test_store_faults.py: I/O faults of the NVMe tier: an injected EIO poisons the optimizer, injected short
transfers and EINTR keep results exact, a truncated state file, validation errors that poison nothing,
and state_dict tensors that outlive close() (which waits for a running step)."""
import errno
import os

import pytest
import torch

from offload.native import aio
from offload.testing import inject_io_fault, state_dir, state_file, tier
from offload.store import StoreFailedError
from store_util import _run_script, assert_same, make_opt, make_params, reference, run_steps  # noqa: F401 (a fixture)


# ---------------------------------------------------------------------------------- faults
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nth", [1, 5, 12])
def test_injected_eio_poisons_optimizer(tmp_path, nth):
    ps = make_params()
    opt = make_opt(ps, storage="nvme", nvme_dir=tmp_path, host_budget=16384)
    run_steps(ps, opt, 2)
    inject_io_fault(opt, aio.FAULT_EIO, nth)
    with pytest.raises(OSError) as ei:
        run_steps(ps, opt, 1, start=2)
    assert ei.value.errno == errno.EIO and ei.value.filename == state_file(opt)
    assert tier(opt).drives[0].aio.outstanding() == 0  # nothing left in flight
    with pytest.raises(StoreFailedError, match="earlier failure"):
        run_steps(ps, opt, 1, start=3)
    with pytest.raises(StoreFailedError):
        opt.state_dict()
    d = state_dir(opt)
    opt.close()
    assert not os.path.exists(d)


@pytest.mark.timeout(60)
def test_injected_short_transfers_keep_results_exact(tmp_path, reference):
    ps = make_params()
    opt = make_opt(ps, storage="nvme", nvme_dir=tmp_path, host_budget=128 * 1024)
    for s in range(12):
        inject_io_fault(opt, aio.FAULT_SHORT if s % 2 else aio.FAULT_EINTR, 1 + s)
        run_steps(ps, opt, 1, start=s)
    tel = opt.storage_info()["engine"]
    # (a short transfer is only injected into pieces of 8 KiB or more: O_DIRECT keeps 4 KiB units)
    assert tel["short_resumed"] >= 3 and tel["eintr_resumed"] >= 5
    assert_same(*reference, ps, opt.state_dict())


@pytest.mark.timeout(60)
def test_real_error_truncated_state_file(tmp_path):
    ps = make_params()
    opt = make_opt(ps, storage="nvme", nvme_dir=tmp_path, host_budget=16384)
    run_steps(ps, opt, 1)
    os.truncate(state_file(opt), 4096)  # e.g. someone else's mistake: the reads now hit end of file
    with pytest.raises(OSError, match="unexpected end of file"):
        run_steps(ps, opt, 1, start=1)
    with pytest.raises(StoreFailedError):
        run_steps(ps, opt, 1, start=2)


@pytest.mark.timeout(30)
def test_validation_errors_do_not_poison(tmp_path):
    ps = make_params()
    opt = make_opt(ps, storage="nvme", nvme_dir=tmp_path, host_budget=16384)
    run_steps(ps, opt, 1)
    ps[0].grad = torch.zeros(2000)[::2]
    with pytest.raises(RuntimeError, match="not contiguous"):
        opt.step()
    ps[0].data = ps[0].data.bfloat16()  # a dtype change would change the bucket layout
    ps[0].grad = None
    with pytest.raises(RuntimeError, match="changed dtype"):
        run_steps(ps, opt, 1, start=1)
    ps[0].data = ps[0].data.float()
    run_steps(ps, opt, 1, start=1)  # still usable: nothing was touched


# ---------------------------------------------------------------------------------- lifetime (issue 10, item 11)
LIFETIME_SCRIPT = """
    import gc, os, sys, threading, time, torch, offload, offload.testing
    d = sys.argv[1]
    def make(mode):
        torch.manual_seed(0)
        ps = [torch.randn(20000), torch.randn(30000).bfloat16()]
        opt = offload.AdamW(ps, storage=mode, nvme_dir=d, host_budget=4 * 65536)  # param 1 split: a copy
        for p in ps:
            p.grad = torch.ones(p.shape, dtype=p.dtype)
        opt.step()
        return opt
    for mode in ("mmap", "nvme"):
        # 1. state_dict() tensors outlive close() and garbage collection of the optimizer
        opt = make(mode)
        sd = opt.state_dict()
        want = {k: {kk: v.clone() for kk, v in st.items()} for k, st in sd["state"].items()}
        sdir = offload.testing.state_dir(opt)
        opt.close()
        assert not os.path.exists(sdir)
        opt2 = make(mode)
        sd2 = opt2.state_dict()
        del opt2
        gc.collect()
        for s in (sd, sd2):
            for k, st in s["state"].items():
                for kk, v in st.items():
                    assert torch.equal(v, want[k][kk]), (k, kk)   # reading them: SIGSEGV before the fix
            s["state"][0]["exp_avg"].add_(1.0)                    # and writing them
        del sd, sd2
        # 2. close() from another thread while a step is inside the kernel: waits for the step
        opt = make(mode)
        sdir = offload.testing.state_dir(opt)
        inside, events, errors = threading.Event(), [], []
        from offload.moments.format import FP32   # the kernel of the bucket body (fp32 moments)
        real = FP32.kernel
        def slow_kernel(*a, **k):
            if not inside.is_set():
                inside.set()
                time.sleep(0.3)
            real(*a, **k)
            events.append("kernel")
        FP32.kernel = slow_kernel
        def stepper():
            try:
                opt.step()
            except BaseException as e:
                errors.append(repr(e))
            events.append("step done")
        t = threading.Thread(target=stepper)
        t.start()
        inside.wait(10)
        opt.close()
        events.append("closed")
        t.join()
        FP32.kernel = real
        # close() waited for the whole step: every kernel call came before it ("step done" is appended by
        # the stepper after opt.step() returned, which may race with the main thread's "closed")
        assert errors == [] and "step done" in events, (mode, errors, events)
        assert max(i for i, e in enumerate(events) if e == "kernel") < events.index("closed"), (mode, events)
        assert not os.path.exists(sdir)
        try:
            opt.step()
        except RuntimeError as e:
            assert "closed" in str(e)
        else:
            raise AssertionError("step after close")
    print("ok")
"""


@pytest.mark.timeout(90)
def test_state_dict_tensors_outlive_close_and_close_waits_for_step(tmp_path):
    # in a subprocess: before the fix, reading the tensors after close()/del was a SIGSEGV
    r = _run_script(LIFETIME_SCRIPT, tmp_path, timeout=80)
    assert r.returncode == 0 and r.stdout.strip() == "ok", f"rc={r.returncode} {r.stderr[-2000:]}"
