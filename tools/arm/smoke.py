"""tools/arm/smoke.py: the cross-built offload._C in aarch64 CPython (tools/arm/check.py runs it
under qemu; numpy only, no torch). Usage: python smoke.py PATH_TO_C_MODULE. The module imports,
names its ISAs, and its Python entries give on every ISA it offers, over three threads, the bits of
the scalar reference: _adam_step (fp32 gradients; bf16 gradients with a bf16 copy and amsgrad),
_adam_step_moments (bf16 and 8-bit moments, two steps), _grad_sumsq (a finite sum near numpy's; inf
for an infinite gradient); and the file I/O engine writes and reads back 1 MiB (O_DIRECT where the
filesystem takes it) in a file beside the module. Prints one line; exit 1 on any difference."""

import importlib.util
import os
import sys

import numpy as np

N = 100_003  # three threads' shares (32K elements each at least), a partial block and vector
F32, BF16, NONE, MOM_BF16, MOM_8 = 1, 2, 0, 2, 8


def load(path):
    spec = importlib.util.spec_from_file_location("offload._C", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bf16(x):
    """Finite float32 values rounded to bf16 bit patterns (nearest even)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def ptr(a):
    return 0 if a is None else a.ctypes.data


def adam_arrays(seed, gd, od):
    r = np.random.default_rng(seed)
    p = r.standard_normal(N, dtype=np.float32)
    m = (r.standard_normal(N, dtype=np.float32) * 0.1).astype(np.float32)
    v = (r.random(N, dtype=np.float32) * 0.01).astype(np.float32)
    g = (r.standard_normal(N, dtype=np.float32) * 3).astype(np.float32)
    return [
        p,
        m,
        v,
        v + np.float32(1e-3),
        g if gd == F32 else bf16(g),
        None if od == NONE else np.zeros(N, np.uint16),
    ]


def moment_arrays(seed, fmt):
    r = np.random.default_rng(seed)
    nb = (N + 255) // 256
    mt, vt = (np.uint16, np.uint16) if fmt == MOM_BF16 else (np.int8, np.uint8)
    return [
        r.standard_normal(N, dtype=np.float32),
        np.zeros(N, mt),
        np.zeros(N, vt),
        np.zeros(nb, np.float32) if fmt == MOM_8 else None,
        np.zeros(nb, np.float32) if fmt == MOM_8 else None,
        r.standard_normal(N, dtype=np.float32),
        None,
    ]


def run_adam(C, arrays, gd, od, amsgrad, reference):
    p, m, v, vm, g, out = arrays
    table = np.array([[ptr(p), ptr(m), ptr(v), ptr(vm), ptr(g), ptr(out), N, 3, gd, od]], np.int64)
    C._adam_step(table, 1e-2, 0.9, 0.999, 1e-8, 0.01, True, amsgrad, False, 1.0, 3, reference)


def run_moments(C, arrays, fmt, step, reference):
    p, m, v, ms, vs, g, out = arrays
    table = np.array(
        [[ptr(p), ptr(m), ptr(v), ptr(ms), ptr(vs), ptr(g), 0, N, step, F32, NONE, fmt]], np.int64
    )
    C._adam_step_moments(
        table, 1e-2, 0.9, 0.999, 1e-8, 0.01, True, False, False, 1.0, 3, reference
    )


def same(a, b):
    return all(x is None or x.tobytes() == y.tobytes() for x, y in zip(a, b))


def aio_roundtrip(C, path):
    """(whether 1 MiB written through AioEngine reads back the same, whether with O_DIRECT)"""
    align = int(C.AIO_DIRECT_ALIGN)

    def aligned(n):
        raw = np.zeros(n + align, np.uint8)
        off = (-raw.ctypes.data) % align
        return raw[off : off + n]

    src, dst = aligned(1 << 20), aligned(1 << 20)
    src[:] = np.random.default_rng(7).integers(0, 256, src.size, dtype=np.uint8)
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError:  # (a filesystem without O_DIRECT)
        fd = os.open(path, flags, 0o600)
    f, eng = C.AioFile(fd, -1), C.AioEngine(4, 1 << 18)
    try:
        wrote = eng.wait(eng.submit(1, f, src))
        read = eng.wait(eng.submit(0, f, dst))
    finally:
        f.close()
        os.remove(path)
    return wrote[1] == 0 and read[1] == 0 and src.tobytes() == dst.tobytes(), f.direct


def main():
    C = load(sys.argv[1])
    C.set_num_threads(3)
    isas, bad = list(C.available_isas()), []
    for isa in isas:
        C.set_isa(isa)
        for gd, od, ams in ((F32, NONE, False), (BF16, BF16, True)):
            ours, ref = adam_arrays(gd, gd, od), adam_arrays(gd, gd, od)
            run_adam(C, ours, gd, od, ams, False)
            run_adam(C, ref, gd, od, ams, True)
            bad += [] if same(ours, ref) else [f"{isa} adam grad {gd} out {od}"]
        for fmt in (MOM_BF16, MOM_8):
            ours, ref = moment_arrays(fmt, fmt), moment_arrays(fmt, fmt)
            for step in (1, 2):
                run_moments(C, ours, fmt, step, False)
                run_moments(C, ref, fmt, step, True)
            bad += [] if same(ours, ref) else [f"{isa} moments {fmt}"]
        g = np.random.default_rng(5).standard_normal(N, dtype=np.float32)
        got = C._grad_sumsq(np.array([[ptr(g), N, F32]], np.int64), 3)
        want = float(np.sum(g.astype(np.float64) ** 2))
        g[N // 2] = np.inf
        inf = C._grad_sumsq(np.array([[ptr(g), N, F32]], np.int64), 3)
        bad += (
            []
            if abs(got - want) <= 1e-9 * want and inf == np.inf
            else [f"{isa} sumsq {got} {want} {inf}"]
        )
    C.set_isa("auto")
    io_ok, direct = aio_roundtrip(
        C, os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), "aio.tmp")
    )
    if not io_ok:
        bad.append("the file I/O engine's write and read back")
    print(
        f"offload._C in CPython {sys.version.split()[0]}: ISAs {', '.join(isas)}, "
        f"chosen {C.get_isa()}; "
        + (
            f"DIFFERENT: {'; '.join(bad)}"
            if bad
            else f"every entry equals the reference; I/O {'O_DIRECT' if direct else 'buffered'} ok"
        )
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
