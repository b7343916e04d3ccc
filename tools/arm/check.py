"""tools/arm/check.py: the aarch64 check that runs without ARM hardware (.ci/run calls it).

1. Gets what it needs when missing (tools/arm/arm_env.py): Debian's cross compiler and qemu-user,
   the aarch64 CPython headers, Debian's aarch64 CPython itself and numpy's aarch64 wheel.
2. Cross-compiles offload._C for aarch64 from setup.py's own tables (sources, per-file ISA flags,
   compile flags) against those headers and pybind11's, links it, and checks that no object but the
   SVE builds holds an SVE instruction and that the module leaves none of its own symbols
   undefined.
3. Links tools/arm/driver.cpp with the native objects and runs it under qemu-user: SVE off (NEON
   every case, scalar a share), SVE at 128, 256 and 512 bits (that length's SVE build every case,
   the other two lengths' builds, which hand their calls to NEON, a share), 384 bits. Each run also
   checks which ISA the dispatch chose (at 128 and 384 bits NEON, else the SVE build of the
   length).
4. Imports the cross-built module in aarch64 CPython under qemu (tools/arm/smoke.py: its Python
   entries on every ISA against the reference, and the file I/O engine), with SVE off and at 256
   bits.

Exit 0 when all of it passes, 1 when anything fails. When the packages cannot be had (not root, no
apt-get, no registry), it prints a loud SKIPPED banner and exits 0, or 1 with ``--require`` (or
OFFLOAD_ARM_CHECK=require).

``--full`` (minutes, not a CI step) adds setup.py's own build_ext run as for an aarch64 host (the
module pip would build there; smoke.py on it), and torch's aarch64 CPU wheel with offload itself in
that CPython: a small model trained on every ISA against torch's AdamW (tools/arm/train_check.py).
``--count``: instructions per element of each loop instead (the qemu plugin
tools/arm/insn_plugin.c; docs/benchmarks.md). ``--jobs N``: parallel compiles and runs."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import hashlib
import os
import re
import runpy
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arm_env import (
    CXX,
    QEMU,
    ROOT,
    WORK,
    Skip,
    ensure_tools,
    log,
    pip_site,
    python_headers,
    run_python,
    sh,
    sysroot,
)  # noqa: E402

# Pybind11Extension's own flags beside setup.py's COMPILE_ARGS (C++17, hidden symbols, no -g).
EXT_ARGS = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-g0"]
# (qemu -cpu options, the ISA the dispatch must choose, tables on every case, tables on a share)
RUNS = [
    ("max,sve=off", "neon", "neon", "scalar"),
    ("max,sve-max-vq=1", "neon", "sve128", "sve256,sve512"),  # (NEON preferred at 128 bits)
    ("max,sve-max-vq=2", "sve256", "sve256", "sve128,sve512"),
    ("max,sve-max-vq=4", "sve512", "sve512", "sve128,sve256"),
    ("max,sve-max-vq=3", "neon", "", ""),
]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # (PyPI's aarch64 torch is a CUDA build)


def compile_one(src: str, flags: list, deps: list) -> str:
    """Object of src compiled with flags, reused while it is newer than src and every header."""
    cmd = [CXX, *flags, "-c", src]
    key = hashlib.sha1(" ".join(cmd).encode()).hexdigest()[:10]
    obj = os.path.join(WORK, "obj", f"{os.path.splitext(os.path.basename(src))[0]}-{key}.o")
    if os.path.exists(obj) and os.path.getmtime(obj) > max(
        os.path.getmtime(p) for p in [src, *deps]
    ):
        return obj
    r = sh([*cmd, "-o", obj], cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"compiling {src} for aarch64 failed:\n{r.stderr[-4000:]}")
    if r.stderr.strip():
        log(f"warnings in {src}:\n{r.stderr.strip()[-2000:]}")
    return obj


def sve_free(obj: str) -> bool:
    """Whether an object's code has no SVE instruction (no z or p register operand)."""
    r = sh(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", obj])
    return r.returncode == 0 and re.search(r"\s[zp]\d+\.[bhsdq]\b", r.stdout) is None


def build(jobs: int, headers, count: bool = False) -> str:
    """offload._C cross-compiled and linked (if `headers`), the driver (and with `count`
    tools/arm/insn_count.cpp) linked; returns the module's path or ''."""
    cwd = os.getcwd()
    os.chdir(ROOT)  # setup.py's globs are relative to the repository root
    try:
        tables = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="offload_build_tables")
        srcs = tables["sources"]("aarch64")
    finally:
        os.chdir(cwd)
    import pybind11

    os.makedirs(os.path.join(WORK, "obj"), exist_ok=True)
    deps = glob.glob(os.path.join(ROOT, "csrc", "*.h"))
    tool_deps = deps + glob.glob(os.path.join(ROOT, "tools", "arm", "*.h"))
    base = [*tables["COMPILE_ARGS"], *EXT_ARGS, "-Icsrc", f"-DOFFLOAD_VERSION={tables['VERSION']}"]
    py_inc = [f"-I{d}" for d in ([pybind11.get_include()] + (headers[0] if headers else []))]
    work = {
        s: [
            *base,
            *(py_inc if s.endswith("python_module.cpp") else []),
            *tables["file_flags"](s, "aarch64"),
        ]
        for s in srcs
        if headers or not s.endswith("python_module.cpp")
    }
    work["tools/arm/driver.cpp"] = [*base, "-Itools/arm"]
    if count:
        work["tools/arm/insn_count.cpp"] = base
    t0 = time.time()
    with cf.ThreadPoolExecutor(jobs) as ex:
        objs = dict(
            zip(
                work,
                ex.map(
                    lambda s: compile_one(
                        s, work[s], tool_deps if s.startswith("tools/") else deps
                    ),
                    work,
                ),
            )
        )
    log(f"compiled {len(objs)} sources for aarch64 in {time.time() - t0:.0f} s")
    leaked = [s for s, o in objs.items() if "_sve" not in s and not sve_free(o)]
    if leaked:
        raise RuntimeError(f"SVE instructions outside the SVE builds: {', '.join(leaked)}")
    ext = ""
    if headers:
        ext = os.path.join(
            WORK,
            "pkg",
            "offload",
            f"_C.cpython-{headers[1].replace('.', '')}-aarch64-linux-gnu.so",
        )
        os.makedirs(os.path.dirname(ext), exist_ok=True)
        r = sh([CXX, "-shared", "-pthread", *[objs[s] for s in srcs], "-o", ext])
        if r.returncode:
            raise RuntimeError(f"linking offload._C for aarch64 failed:\n{r.stderr[-4000:]}")
        undef = sh(["aarch64-linux-gnu-nm", "-D", "--undefined-only", "-C", ext]).stdout
        ours = [line for line in undef.splitlines() if "offload::" in line]
        if ours:
            raise RuntimeError(
                "offload._C for aarch64 leaves its own symbols undefined:\n" + "\n".join(ours)
            )
        log(f"built {os.path.relpath(ext, ROOT)} against aarch64 Python {headers[1]} headers")
    native = [o for s, o in objs.items() if s in srcs and s != "csrc/python_module.cpp"]
    for main_src in [s for s in work if s.startswith("tools/")]:
        exe = os.path.join(WORK, os.path.splitext(os.path.basename(main_src))[0])
        r = sh([CXX, "-static", "-pthread", *native, objs[main_src], "-o", exe])
        if r.returncode:
            raise RuntimeError(f"linking {main_src} failed:\n{r.stderr[-4000:]}")
    return ext


def run_driver(cpu: str, expect: str, full: str, share: str) -> tuple:
    cmd = [
        QEMU,
        "-cpu",
        cpu,
        os.path.join(WORK, "driver"),
        "--expect",
        expect,
        "--full",
        full,
        "--share",
        share,
    ]
    t0 = time.time()
    r = sh(cmd)
    return (
        r.returncode == 0,
        f"driver, qemu -cpu {cpu} ({time.time() - t0:.0f} s): {(r.stdout + r.stderr).strip()}",
    )


def setuptools_build(version: str) -> str:
    """offload._C built by setup.py's own build_ext as for an aarch64 host (the platform set
    through _PYTHON_HOST_PLATFORM, the compilers through CC/CXX/LDSHARED, the aarch64 headers
    first): what pip install runs there. Returns the module's path (named for aarch64)."""
    inc = os.path.join(WORK, "pyheaders", "usr", "include")
    flags = f"-I{inc}/python{version} -I{inc}"
    env = dict(
        os.environ,
        _PYTHON_HOST_PLATFORM="linux-aarch64",
        CC="aarch64-linux-gnu-gcc",
        CXX=CXX,
        LDSHARED=f"{CXX} -shared",
        LDCXXSHARED=f"{CXX} -shared",
        CFLAGS=flags,
        CPPFLAGS=flags,
        LDFLAGS="",
    )
    out = os.path.join(WORK, "setuptools")
    r = sh(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            out,
            "--build-temp",
            os.path.join(out, "tmp"),
        ],
        env=env,
        cwd=ROOT,
    )
    found = glob.glob(os.path.join(out, "offload", "_C.*.so"))
    if r.returncode or not found:
        raise RuntimeError(
            f"setup.py build_ext for aarch64 failed:\n{(r.stdout + r.stderr)[-4000:]}"
        )
    dest = os.path.join(out, f"_C.cpython-{version.replace('.', '')}-aarch64-linux-gnu.so")
    shutil.copy(found[0], dest)
    return dest


def python_runs(ext: str, version: str, full: bool, skipped: list) -> list:
    """[(cpu, script args, PYTHONPATH)] of the aarch64 CPython stages (Skip if CPython or numpy
    cannot be had; torch for `full` not had: its runs left out, said in `skipped`)."""
    sysroot(version)
    numpy = pip_site("numpy", version, "numpy")
    runs = [
        (cpu, ["tools/arm/smoke.py", ext], [numpy]) for cpu in ("max,sve=off", "max,sve-max-vq=2")
    ]
    if full:
        built = setuptools_build(version)
        runs += [("max,sve-max-vq=4", ["tools/arm/smoke.py", built], [numpy])]
        try:
            torch = pip_site("torch", version, "torch==2.13.0", "numpy", index=TORCH_CPU_INDEX)
        except Skip as e:
            skipped.append(f"the training run in aarch64 CPython: {e}")
            return runs
        pkg = os.path.dirname(os.path.dirname(ext))  # offload's sources beside the module
        shutil.copytree(
            os.path.join(ROOT, "offload"),
            os.path.join(pkg, "offload"),
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("_C.*", "__pycache__"),
        )
        runs += [
            (cpu, ["tools/arm/train_check.py"], [pkg, torch])
            for cpu in ("max,sve-max-vq=1", "max,sve-max-vq=4")
        ]
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--require", action="store_true", help="fail instead of skipping if packages cannot be had"
    )
    ap.add_argument(
        "--full", action="store_true", help="also train with torch in aarch64 CPython (minutes)"
    )
    ap.add_argument(
        "--count", action="store_true", help="instructions per element of each loop instead"
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args(argv)
    require = args.require or os.environ.get("OFFLOAD_ARM_CHECK") == "require"
    t0 = time.time()
    os.makedirs(WORK, exist_ok=True)
    skipped, ext, headers, py_runs, built = [], "", None, [], False
    try:
        ensure_tools()
        log(f"tools ready ({time.time() - t0:.0f} s)")
        try:
            headers = python_headers()
        except Skip as e:
            skipped.append(f"the Python extension's cross-build and its import: {e}")
        ext, built = build(args.jobs, headers, count=args.count), True
        if args.count:
            from count import count_insns

            count_insns(args.jobs)
            return 0
        if ext:
            try:
                py_runs = python_runs(ext, headers[1], args.full, skipped)
            except Skip as e:
                skipped.append(f"the import in aarch64 CPython: {e}")
    except Skip as e:
        skipped.append(f"the aarch64 build and its bitwise check (all of it): {e}")
    except RuntimeError as e:
        log(f"FAILED: {e}")
        return 1
    bar = "!" * 78
    for what in skipped:
        print(f"{bar}\n[arm-check] SKIPPED {what}\n{bar}", file=sys.stderr, flush=True)
    ok = not (require and skipped)
    if built:
        with cf.ThreadPoolExecutor(args.jobs) as ex:
            done = [ex.submit(run_driver, *run) for run in RUNS]
            done += [ex.submit(run_stage, headers[1], *run) for run in py_runs]
            for f in done:
                passed, text = f.result()
                ok &= passed
                log(("" if passed else "FAILED: ") + text)
    log(
        f"{'passed' if ok else 'FAILED'}{' (parts skipped)' if skipped else ''}"
        f" in {time.time() - t0:.0f} s"
    )
    return 0 if ok else 1


def run_stage(version: str, cpu: str, script: list, path: list) -> tuple:
    t0 = time.time()
    r = run_python(sysroot(version), version, cpu, script, path, timeout=1800)
    text = (r.stdout + r.stderr).strip()[-3000:]
    return (
        r.returncode == 0,
        f"{script[0]} in aarch64 CPython, qemu -cpu {cpu} ({time.time() - t0:.0f} s): {text}",
    )


if __name__ == "__main__":
    sys.exit(main())
