"""Memory safety of the native layer against ordinary Python (issue 10, items 10, 13, 14).

Every case that could crash the interpreter runs in a subprocess (``_run``): a segfault or a hang
is a failed test, not the end of the run. Covers: the native grad gather when a callback mutates
its lists; tensors whose storage is smaller than their view (``untyped_storage().resize_``);
negative/conjugate views; overlapping outputs; the raw-address entries being private; fork()
with a live AioEngine (child submits and exits).
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import offload
import offload.testing
from offload import _C, kernels
from offload.native import adam as _kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that imports this checkout; a crash or hang fails the test.

    The snippet runs in its own session, so a hang kills it and anything it forked.
    """
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"subprocess hung for {timeout} s; output so far:\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # forked children left behind by a failed snippet
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"subprocess died with return code {proc.returncode}:\n{out}\n{err}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)


# ---------------------------------------------------------------- collect_rows (item 14)
@pytest.mark.timeout(90)
def test_collect_rows_survives_callbacks_that_shrink_the_lists():
    # Every getter collect_rows calls may run Python (here: stand-ins for torch's grad descriptor,
    # data_ptr, stride, is_neg, untyped_storage) that shrinks the lists mid-gather. Without strong
    # references and size re-checks the gather read freed slots (use after free / segfault).
    r = _run("""
        import torch, offload
        import offload.testing
        from offload import _C
        from offload.native.rows import ROW_FNS
        F = list(ROW_FNS)
        for where in ("grad", "data_ptr", "stride", "is_neg", "untyped_storage"):
            n = 64
            params = [torch.nn.Parameter(torch.randn(8)) for _ in range(n)]
            for p in params:
                p.grad = torch.randn(8)
            opt = offload.AdamW(params)
            opt.step()
            plan = offload.testing.row_records(opt)[0]
            plist, refs, lays = list(plan.params), list(plan.g_ref), list(plan.layouts)
            if where == "untyped_storage":  # reached for new gradients only
                for p in params:
                    p.grad = torch.randn(8)
            def shrink():
                del plist[1:], refs[1:], lays[1:]
            class Grad:
                def __get__(self, obj, typ):
                    shrink()
                    return torch._C.TensorBase.__dict__["grad"].__get__(obj, typ)
            fns = list(F)
            k = {"grad": 0, "data_ptr": 1, "stride": 3, "is_neg": 4, "untyped_storage": 11}[where]
            orig = F[k]
            fns[k] = Grad() if where == "grad" else (lambda t, orig=orig: (shrink(), orig(t))[1])
            try:
                _C.collect_rows(plist, refs, plan.meta, lays, plan.table, tuple(fns))
            except RuntimeError as e:
                print(where, "refused:", e, flush=True)
            else:
                print(where, "no error", flush=True)
    """, timeout=60.0)
    for where in ("grad", "data_ptr", "stride", "is_neg", "untyped_storage"):
        assert f"{where} refused: collect_rows: the parameter list changed size" in r.stdout, r.stdout


def test_collect_rows_refuses_bad_arguments():
    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(8)
    opt = offload.AdamW(params)
    opt.step()
    plan = offload.testing.row_records(opt)[0]
    from offload.native.rows import ROW_FNS
    with pytest.raises(ValueError, match="one entry per parameter"):
        _C.collect_rows(plan.params[:2], plan.g_ref, plan.meta, plan.layouts, plan.table, ROW_FNS)
    with pytest.raises(ValueError, match="rec must be a writable"):
        _C.collect_rows(plan.params, plan.g_ref, plan.meta[:2], plan.layouts, plan.table, ROW_FNS)
    with pytest.raises(ValueError, match="table must be a writable"):
        _C.collect_rows(plan.params, plan.g_ref, plan.meta, plan.layouts, plan.table.astype("int32"), ROW_FNS)
    ro = plan.table.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="table must be a writable"):
        _C.collect_rows(plan.params, plan.g_ref, plan.meta, plan.layouts, ro, ROW_FNS)
    with pytest.raises(ValueError, match="fns must hold"):
        _C.collect_rows(plan.params, plan.g_ref, plan.meta, plan.layouts, plan.table, ROW_FNS[:5])


# ---------------------------------------------------------------- storage bounds (item 10)
@pytest.mark.timeout(60)
def test_kernels_refuse_tensors_larger_than_their_storage():
    # A view whose storage was shrunk under it (untyped_storage().resize_) must be refused by
    # name; without the bounds check the kernel wrote 4 MiB past a 16-byte allocation.
    r = _run(f"""
        import torch, offload
        n = 1 << 20
        for victim in ("param", "grad", "exp_avg", "out", "sumsq"):
            p, g, m, v = (torch.zeros(n) for _ in range(4))
            out = torch.zeros(n, dtype=torch.bfloat16)
            t = dict(param=p, grad=g, exp_avg=m, out=out, sumsq=g)[victim]
            t.untyped_storage().resize_(16)
            try:
                if victim == "sumsq":
                    offload.kernels.grad_sumsq([g])
                else:
                    offload.kernels.adam_step([p], [g], [m], [v], None, [1], outs=[out], **{ADAM!r})
            except RuntimeError as e:
                print(victim, "refused:", e, flush=True)
            else:
                print(victim, "no error", flush=True)
    """)
    for victim, name in (("param", "params[0]"), ("grad", "grads[0]"), ("exp_avg", "exp_avgs[0]"),
                         ("out", "outs[0]"), ("sumsq", "grads[0]")):
        assert f"{victim} refused: {name} reaches byte" in r.stdout and "storage holds only 16 bytes" in r.stdout, \
            r.stdout


def test_storage_bounds_with_offset_views():
    base = torch.zeros(100)
    view = base[90:]  # in bounds
    kernels.check_tensor(view, "x")
    base.untyped_storage().resize_(95 * 4)  # the view now reaches 5 elements past the storage
    with pytest.raises(RuntimeError, match=r"x .*storage"):
        kernels.check_tensor(view, "x")
    empty = torch.zeros(0)
    kernels.check_tensor(empty, "e")


def test_tensor_signature_sees_every_change():
    p = torch.zeros(2000)
    sig = kernels.tensor_signature(p)
    assert sig == kernels.tensor_signature(p)
    changes = {
        "same-pointer shrink": lambda t: setattr(t, "data", t.data[:1000]),
        "transpose": lambda t: setattr(t, "data", t.data.view(40, 50).t()),
        "reshape": lambda t: setattr(t, "data", t.data.view(40, 50)),
        "storage resize": lambda t: t.untyped_storage().resize_(4000),
        "dtype view": lambda t: setattr(t, "data", t.data.view(torch.int32)),
    }
    for what, change in changes.items():
        q = torch.zeros(2000)
        before = kernels.tensor_signature(q)
        change(q)
        assert kernels.tensor_signature(q) != before, what


def test_neg_and_conj_views_are_refused():
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    neg = torch._neg_view(torch.ones(8))
    assert neg.is_neg()
    with pytest.raises(RuntimeError, match="negative-bit"):
        kernels.adam_step([p], [neg], [m], [v], None, [1], **ADAM)
    with pytest.raises(RuntimeError, match="negative-bit"):
        kernels.grad_sumsq([neg])


def test_overlapping_outputs_across_tensors_are_refused():
    buf = torch.zeros(64)
    g = torch.ones(32)
    m1, v1, m2, v2 = (torch.zeros(32) for _ in range(4))
    with pytest.raises(ValueError, match="overlap"):
        kernels.adam_step([buf[:32], buf[16:48]], [g, g], [m1, m2], [v1, v2], None, [1, 1], **ADAM)
    with pytest.raises(ValueError, match="overlap"):
        kernels.adam_step([buf[:32], buf[32:]], [g, g], [m1, m1], [v1, v2], None, [1, 1], **ADAM)
    # adjacent, disjoint views are fine; a gradient shared by two params is only read
    kernels.adam_step([buf[:32], buf[32:]], [g, g], [m1, m2], [v1, v2], None, [1, 1], **ADAM)
    assert torch.all(buf != 0)


def test_bandwidth_probe_takes_tensors():
    p, m, v, g = (torch.zeros(1024) for _ in range(4))
    kernels.bandwidth_probe(p, m, v, g)
    with pytest.raises(RuntimeError, match="elements"):
        kernels.bandwidth_probe(p, m, v, torch.zeros(10))


@pytest.mark.parametrize("isa", kernels.available_isas())
@pytest.mark.parametrize("mdtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", range(len(kernels.MOMENT_PROBE_MODES)))
def test_moment_streams_probe_touches_every_element_of_its_streams(isa, mdtype, gdtype, mode):
    n = (1 << 19) + 1037 if mode == 2 else 1000 + 37  # tiles: two threads' tiles and a short last one
    kernels.set_isa(isa)
    try:
        p = torch.arange(n, dtype=torch.float32)
        m, v = torch.zeros(n, dtype=mdtype), torch.full((n,), 5, dtype=mdtype)
        g = (torch.arange(n) % 7).to(gdtype)
        out = torch.full((n,), 3, dtype=torch.int16).view(torch.bfloat16) if gdtype != torch.float32 else None
        kernels.bandwidth_probe_moments(p, m, v, g, out, threads=2, mode=mode)
    finally:
        kernels.set_isa("auto")
    want_g = g.float() if gdtype == torch.float32 else g.view(torch.int16).float()  # a 2-byte grad: its bits
    assert torch.equal(p, torch.arange(n, dtype=torch.float32) + 0.5 * want_g)
    if mdtype == torch.float32:
        assert torch.equal(m, torch.ones(n)) and torch.equal(v, torch.full((n,), 4.0))
    else:  # 2- and 1-byte moments: +1 / -1 on their integer bits
        bits = torch.int16 if mdtype == torch.bfloat16 else torch.int8
        v0 = torch.full((n,), 5, dtype=mdtype).view(bits)
        assert torch.equal(m.view(bits), torch.ones(n, dtype=bits)) and torch.equal(v.view(bits), v0 - 1)
    if out is not None:  # read and written: any value, this one
        assert torch.equal(out.view(torch.int16), torch.full((n,), 4, dtype=torch.int16))


def test_moment_streams_probe_validates_its_tensors():
    p, g = torch.zeros(64), torch.zeros(64)
    m, v = torch.zeros(64, dtype=torch.int8), torch.zeros(64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="elements"):
        kernels.bandwidth_probe_moments(p, m, v[:10], g)
    with pytest.raises((TypeError, ValueError), match="dtype|m must"):
        kernels.bandwidth_probe_moments(p, m, torch.zeros(64, dtype=torch.bfloat16), g)
    with pytest.raises(TypeError, match="1-, 2- or 4-byte"):
        kernels.bandwidth_probe_moments(p, torch.zeros(64, dtype=torch.float64), v, g)
    with pytest.raises(ValueError, match="overlap"):
        kernels.bandwidth_probe_moments(p, m, m, g)
    with pytest.raises((TypeError, ValueError, RuntimeError), match="contiguous"):
        kernels.bandwidth_probe_moments(torch.zeros(128)[::2], m, v, g)
    with pytest.raises(ValueError, match="mode"):
        kernels.bandwidth_probe_moments(p, m, v, g, mode=3)


def test_raw_address_entries_are_private():
    # Entries that dereference integer addresses are underscore-private; the public API takes tensors.
    for name in ("adam_step", "grad_sumsq", "bandwidth_probe", "bandwidth_probe_moments", "adam_step_moments", "fingerprint"):
        assert not hasattr(_C, name), name
        assert hasattr(_C, "_" + name)
    assert not hasattr(kernels, "step_table") and not hasattr(kernels, "step_moment_table")  # internal (offload.native.adam.step_table... callers only)
    public = set(kernels.__all__)
    assert {"adam_step", "grad_sumsq", "check_tensor", "tensor_signature", "bandwidth_probe"} <= public
    assert offload.kernels is kernels


# ---------------------------------------------------------------- fork (item 13)
FORK_SETUP = """
    import os, sys, tempfile, time, signal
    import torch
    from offload.native import aio
    from offload.base.memory import aligned_empty
    d = tempfile.mkdtemp()
    eng = aio.AioEngine(queue_depth=2, block_size=4096)
    f = eng.open(os.path.join(d, "f"), create=True, direct=False)
    buf = aligned_empty(1 << 16)
    eng.write(f, buf).wait(timeout=10)
    busy = eng.write(f, aligned_empty(16 << 20), offset=1 << 16)  # workers mid-transfer at fork time

    def reap(pid, limit=8.0):
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "hung"
"""


@pytest.mark.timeout(60)
def test_fork_with_a_live_engine():
    # Child 1 only exits (atexit finalizers and the engine destructor run there: they used to join
    # worker threads that do not exist in the child and hang). Child 2 tries the parent's engine
    # (clear RuntimeError, nothing locked) and makes its own. Child 3 steps with the native thread
    # pool the parent had started. The parent's engine keeps working.
    r = _run(FORK_SETUP + """
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    print("child 1:", reap(pid), flush=True)
    pid = os.fork()
    if pid == 0:
        for what, call in (("engine", lambda: eng.write(f, buf)),
                           ("native", lambda: eng._native.submit(1, f._handle, buf.numpy(), 4096, 0)),
                           ("native wait", lambda: eng._native.wait(busy.id, 0.0))):
            try:
                call()
                print(what, "accepted", flush=True)
            except RuntimeError as e:
                print(what, "refused:", e, flush=True)
        with aio.AioEngine(queue_depth=1, block_size=4096) as own:
            g = own.open(os.path.join(d, "child"), create=True, direct=False)
            print("child engine:", own.write(g, buf).wait(timeout=10), flush=True)
            g.close()
        sys.exit(0)
    print("child 2:", reap(pid), flush=True)
    # the native thread pool (csrc/threadpool.cpp) starts afresh in a child: a 2-thread step works.
    # numpy-backed tensors and no torch ops in the child: torch's own OpenMP pool is not fork-safe
    # (a large torch op in a forked child hangs in libgomp, with or without offload).
    import numpy as np
    from offload import kernels
    def step(ref):
        n = 1 << 17
        a = [np.zeros(n, np.float32) for _ in range(4)]
        a[0][:] = np.linspace(-1, 1, n)
        a[3][:] = np.linspace(1, -1, n)
        p, m, v, g = (torch.from_numpy(x) for x in a)
        kernels.adam_step([p], [g], [m], [v], None, [1], lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.0, decoupled=True, threads=2, reference=ref)
        return a[0]
    step(False)  # the parent's pool is running
    pid = os.fork()
    if pid == 0:
        print("child pool:", np.array_equal(step(False), step(True)), flush=True)
        os._exit(0)
    print("child 3:", reap(pid), flush=True)
    print("parent busy:", busy.wait(timeout=30))
    print("parent ok:", eng.write(f, buf).wait(timeout=10))
    """)
    out = r.stdout
    assert "child 1: 0" in out and "child 2: 0" in out and "child 3: 0" in out, out + r.stderr
    assert "child pool: True" in out
    assert out.count("refused:") == 3 and "accepted" not in out, out
    assert "cannot be used after fork" in out and "create the optimizer in the child" in out
    assert "child engine: 65536" in out and f"parent busy: {16 << 20}" in out and "parent ok: 65536" in out
