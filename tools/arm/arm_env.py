"""tools/arm/arm_env.py: what the aarch64 checks (tools/arm/check.py) need from the machine,
fetched without touching its package state beyond two ordinary packages:

- ``ensure_tools``: Debian's ``g++-aarch64-linux-gnu`` and ``qemu-user`` (apt-get install, as
  root).
- ``apt_arm64``: apt for arm64 against a private state under ``build/arm-check/apt`` (the system's
  sources; no ``dpkg --add-architecture``, nothing installed): ``python_headers`` unpacks
  ``libpython3.X-dev:arm64`` from it, ``sysroot`` Debian's aarch64 CPython and its libraries.
- ``pip_site``: aarch64 wheels (``pip install --target`` with ``--platform``) for that CPython.
- ``run_python``: that CPython under qemu-user. ``Skip`` is raised where a package cannot be had
  (not root, no apt-get, no registry)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORK = os.path.join(ROOT, "build", "arm-check")
CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
PACKAGES = ["g++-aarch64-linux-gnu", "qemu-user"]
PY = f"{sys.version_info.major}.{sys.version_info.minor}"  # the CPython the extension is built for


class Skip(Exception):
    """What the check needs cannot be installed here."""


def log(msg: str) -> None:
    print(f"[arm-check] {msg}", flush=True)


def sh(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def ensure_tools() -> None:
    missing = [t for t in (CXX, QEMU, "dpkg-deb") if shutil.which(t) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise Skip(f"{', '.join(missing)} missing and no apt-get to install {' '.join(PACKAGES)}")
    if os.geteuid() != 0:
        raise Skip(f"{', '.join(missing)} missing; installing {' '.join(PACKAGES)} needs root")
    log(f"installing {' '.join(PACKAGES)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ):
        r = sh(cmd, env=env)
        if r.returncode:
            raise Skip(f"{' '.join(cmd)} failed: {(r.stderr or r.stdout).strip()[-600:]}")
    if any(shutil.which(t) is None for t in (CXX, QEMU)):
        raise Skip(f"{' '.join(PACKAGES)} installed but {CXX} or {QEMU} still missing")


def apt_arm64(*args: str) -> subprocess.CompletedProcess:
    """apt-get (apt-cache for ``depends``) for arm64 with a private state directory."""
    state = os.path.join(WORK, "apt")
    for d in ("lists/partial", "cache/archives/partial"):
        os.makedirs(os.path.join(state, d), exist_ok=True)
    opts = [
        "-o",
        f"Dir::State::Lists={state}/lists",
        "-o",
        f"Dir::Cache={state}/cache",
        "-o",
        "APT::Architecture=arm64",
        "-o",
        "APT::Architectures=arm64",
        "-o",
        "Dir::State::status=/dev/null",
        "-o",
        "Debug::NoLocking=1",
    ]
    if os.geteuid() == 0:
        opts += ["-o", "APT::Sandbox::User=root"]
    marker = os.path.join(state, "updated")
    if args[0] == "update":
        r = sh(["apt-get", "-q", *opts, "update"], cwd=state)
        if r.returncode:
            raise Skip(f"apt-get update (arm64 lists) failed: {r.stderr.strip()[-600:]}")
        open(marker, "w").close()
        return r
    if not os.path.exists(marker):
        apt_arm64("update")
    tool = "apt-cache" if args[0] == "depends" else "apt-get"
    r = sh([tool, "-q", *opts, *args], cwd=state)
    if r.returncode and tool == "apt-get":  # lists from an earlier run may be stale: once more
        apt_arm64("update")
        r = sh([tool, "-q", *opts, *args], cwd=state)
    return r


def unpack(debs: list, dest: str) -> None:
    for deb in debs:
        r = sh(["dpkg-deb", "-x", deb, dest])
        if r.returncode:
            raise RuntimeError(f"dpkg-deb -x {deb}: {r.stderr}")


def python_headers() -> tuple:
    """(include dirs, Python version) of aarch64 CPython headers, fetched once into WORK."""
    if shutil.which("apt-get") is None:
        raise Skip("no apt-get to fetch the aarch64 Python headers")
    dest = os.path.join(WORK, "pyheaders")
    found = glob.glob(os.path.join(dest, "usr/include/python3.*/Python.h"))
    if not found:
        names = [f"libpython{PY}-dev"]  # else the distribution's own version
        dep = apt_arm64("depends", "libpython3-dev").stdout.split()
        names += [w.split(":")[0] for w in dep if w.startswith("libpython3.") and "-dev" in w]
        if not any(apt_arm64("download", name).returncode == 0 for name in names):
            raise Skip(f"could not download any of {', '.join(n + ':arm64' for n in names)}")
        shutil.rmtree(dest, ignore_errors=True)
        debs = glob.glob(os.path.join(WORK, "apt", "libpython3.*-dev_*_arm64.deb"))
        unpack(debs, dest)
        for deb in debs:
            os.remove(deb)
        found = glob.glob(os.path.join(dest, "usr/include/python3.*/Python.h"))
        if not found:
            raise Skip("the downloaded package has no Python.h")
    inc = os.path.dirname(found[0])
    return [inc, os.path.join(dest, "usr/include")], os.path.basename(inc)[len("python") :]


def sysroot(version: str) -> str:
    """Debian's aarch64 CPython `version` and the libraries it and torch load, unpacked once."""
    dest = os.path.join(WORK, "sysroot")
    if not os.path.exists(os.path.join(dest, "usr", "bin", f"python{version}")):
        r = apt_arm64(
            "install",
            "--download-only",
            "-y",
            "--no-install-recommends",
            f"python{version}",
            "libstdc++6",
            "libgomp1",
        )
        if r.returncode:
            raise Skip(f"could not download aarch64 python{version}: {r.stderr.strip()[-600:]}")
        unpack(glob.glob(os.path.join(WORK, "apt", "cache", "archives", "*.deb")), dest)
    return dest


def pip_site(name: str, version: str, *specs: str, index: str = "") -> str:
    """aarch64 wheels of `specs` for CPython `version` in WORK/site-<name> (installed once)."""
    dest = os.path.join(WORK, f"site-{name}")
    if not os.path.exists(os.path.join(dest, ".done")):
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--target",
            dest,
            "--only-binary=:all:",
            "--platform",
            "manylinux_2_28_aarch64",
            "--platform",
            "manylinux2014_aarch64",
            "--python-version",
            version,
            "--implementation",
            "cp",
            "--abi",
            f"cp{version.replace('.', '')}",
            *(["--index-url", index] if index else []),
            *specs,
        ]
        r = sh(cmd)
        if r.returncode:
            raise Skip(
                f"pip could not fetch aarch64 wheels of {' '.join(specs)}: "
                f"{r.stderr.strip()[-600:]}"
            )
        open(os.path.join(dest, ".done"), "w").close()
    return dest


def run_python(
    root: str, version: str, cpu: str, args: list, path: list, timeout: int = 600
) -> subprocess.CompletedProcess:
    """aarch64 CPython of sysroot `root` under qemu (-cpu `cpu`) with PYTHONPATH `path`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONDONTWRITEBYTECODE="1")
    return sh(
        [
            QEMU,
            "-L",
            root,
            "-cpu",
            cpu,
            os.path.join(root, "usr", "bin", f"python{version}"),
            *args,
        ],
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )
