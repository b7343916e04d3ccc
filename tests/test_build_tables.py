"""test_build_tables.py: setup.py's per-architecture build tables: which kernels_<isa>.cpp each
target architecture compiles and with which flags (x86-64: AVX2 and AVX-512; aarch64: NEON with no
flag and SVE for each fixed vector length; any other: scalar only), read without building. The
aarch64 build itself is cross-compiled and checked under qemu by tools/arm/check.py (.ci/run)."""

import glob
import os
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tables(request):
    cwd = os.getcwd()
    os.chdir(ROOT)  # setup.py globs csrc/ from the repository root
    request.addfinalizer(lambda: os.chdir(cwd))
    return runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="offload_build_tables")


def kernel_files(srcs):
    return sorted(os.path.basename(s) for s in srcs if os.path.basename(s).startswith("kernels_"))


def test_each_architecture_compiles_its_own_kernels_only(tables):
    src = tables["sources"]
    assert kernel_files(src("x86_64")) == [
        "kernels_avx2.cpp",
        "kernels_avx512.cpp",
        "kernels_scalar.cpp",
    ]
    assert kernel_files(src("aarch64")) == [
        "kernels_neon.cpp",
        "kernels_scalar.cpp",
        "kernels_sve128.cpp",
        "kernels_sve256.cpp",
        "kernels_sve512.cpp",
    ]
    assert kernel_files(src("riscv64")) == ["kernels_scalar.cpp"]
    # every other source on every architecture, each once
    for arch in ("x86_64", "aarch64", "riscv64"):
        common = [s for s in src(arch) if not os.path.basename(s).startswith("kernels_")]
        assert len(set(src(arch))) == len(src(arch))
        assert sorted(common) == sorted(
            s for s in src("x86_64") if not os.path.basename(s).startswith("kernels_")
        )
    # every kernels_*.cpp on disk is some architecture's (a new one without a table entry would be
    # compiled with no ISA flag at all)
    on_disk = kernel_files(glob.glob(os.path.join(ROOT, "csrc", "kernels_*.cpp")))
    assert on_disk == sorted(set(kernel_files(src("x86_64")) + kernel_files(src("aarch64"))))


def test_isa_flags_go_to_their_kernel_file_only(tables):
    flags = tables["file_flags"]
    assert flags("csrc/kernels_avx2.cpp", "x86_64") == ["-mavx2", "-mfma", "-mf16c"]
    assert "-mavx512f" in flags("csrc/kernels_avx512.cpp", "x86_64")
    assert flags("csrc/kernels_neon.cpp", "aarch64") == []
    for bits in (128, 256, 512):
        assert flags(f"csrc/kernels_sve{bits}.cpp", "aarch64") == [
            "-march=armv8-a+sve",
            f"-msve-vector-bits={bits}",
        ]
    for arch in ("x86_64", "aarch64", "riscv64"):
        for s in tables["sources"](arch):
            if not os.path.basename(s).startswith("kernels_") or s.endswith("kernels_scalar.cpp"):
                assert flags(s, arch) == [], s
    assert "-ffp-contract=off" in tables["COMPILE_ARGS"]
    assert not any(a.startswith(("-march=native", "-mcpu=native")) for a in tables["COMPILE_ARGS"])


def test_target_arch_names(tables, monkeypatch):
    arch = tables["target_arch"]
    monkeypatch.setenv("_PYTHON_HOST_PLATFORM", "linux-aarch64")  # a cross build's target
    assert arch() == "aarch64"
    monkeypatch.setenv("_PYTHON_HOST_PLATFORM", "linux-x86_64")
    assert arch() == "x86_64"
    assert [arch(m) for m in ("x86_64", "AMD64", "aarch64", "arm64", "riscv64")] == [
        "x86_64",
        "x86_64",
        "aarch64",
        "aarch64",
        "riscv64",
    ]
