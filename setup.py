# setup.py: builds offload._C with pybind11 against no torch headers, no OpenMP runtime and no
# host-specific architecture flag. kernels_<isa>.cpp files get that ISA's flags and nothing else
# does; the best ISA the CPU supports is chosen at import (csrc/cpu_features.cpp).
import os
import re
import sysconfig
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = re.search(r'__version__ = "([^"]+)"', open(os.path.join(HERE, "offload", "_version.py")).read()).group(1)

# The vector ISAs of each target architecture and their flags. x86-64: AVX2 and AVX-512. aarch64:
# NEON (the baseline: no flag) and SVE built for each fixed vector length the kernels support (a
# CPU whose length is another runs NEON; csrc/kernels_sve.h). Any other architecture: scalar only.
ISA_FLAGS = {
    "x86_64": {
        "avx2": ["-mavx2", "-mfma", "-mf16c"],
        # (-Wno-maybe-uninitialized: a GCC 12 false positive in avx512fintrin.h)
        "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
                   "-mf16c", "-Wno-maybe-uninitialized"],
    },
    "aarch64": {
        "neon": [],
        **{f"sve{bits}": ["-march=armv8-a+sve", f"-msve-vector-bits={bits}"]
           for bits in (128, 256, 512)},
    },
}
ARCH_ALIASES = {"amd64": "x86_64", "i386": "x86_64", "i686": "x86_64", "x86": "x86_64",
                "arm64": "aarch64"}


def target_arch(machine=None):
    """The ISA_FLAGS key of a machine name; scalar-only ones: the name. Default: the platform the
    build is for (sysconfig's, which a cross build sets through _PYTHON_HOST_PLATFORM)."""
    m = (machine or sysconfig.get_platform().rsplit("-", 1)[-1]).lower()
    return ARCH_ALIASES.get(m, m)


# -O3 everywhere; -ffp-contract=off: no silent FMA contraction, so every ISA path rounds exactly
# like the scalar reference (bitwise-identical results; see csrc/simd.h).
COMPILE_ARGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra"]

# The Python-facing sources (argument conversion, GIL release, table checks, the per-row calls into
# torch's getters) are compiled as one translation unit, csrc/python_module.cpp, at -O3 like the rest:
# pybind11's headers cost ~6-7 s of compiler time per unit, so one unit instead of four saves ~20 s.
IN_PYTHON_MODULE = ["csrc/bindings.cpp", "csrc/aio_bindings.cpp", "csrc/moments_bindings.cpp", "csrc/rows.cpp"]
# The longest compiles first (x86-64: ~22, 22, 19 and 5 s on one core; ParallelCompile hands the
# files out in this order), so that on 2 cores the rest fills in around them instead of one of them
# starting last.
LONGEST_FIRST = {
    "x86_64": ["csrc/kernels_avx2.cpp", "csrc/kernels_avx512.cpp", "csrc/python_module.cpp",
               "csrc/kernels_scalar.cpp"],
    "aarch64": ["csrc/kernels_sve512.cpp", "csrc/kernels_sve256.cpp", "csrc/kernels_sve128.cpp",
                "csrc/kernels_neon.cpp", "csrc/python_module.cpp", "csrc/kernels_scalar.cpp"],
}


def sources(arch):
    """The sources of offload._C for a target architecture: no other architecture's kernels."""
    other = {f"csrc/kernels_{isa}.cpp"
             for a, isas in ISA_FLAGS.items() if a != arch for isa in isas}
    first = LONGEST_FIRST.get(arch, ["csrc/python_module.cpp", "csrc/kernels_scalar.cpp"])
    return first + sorted(set(glob("csrc/*.cpp")) - set(IN_PYTHON_MODULE) - set(first) - other)


def file_flags(src, arch):
    """The ISA flags of one source: only csrc/kernels_<isa>.cpp gets its ISA's."""
    isas = ISA_FLAGS.get(arch, {})
    return next((flags for isa, flags in isas.items() if src.endswith(f"kernels_{isa}.cpp")), [])


class BuildExt(build_ext):
    """Adds per-file flags: only csrc/kernels_<isa>.cpp is compiled for that ISA."""

    def build_extensions(self):
        compiler = self.compiler
        original = compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            extra = list(extra_postargs) + file_flags(src, ARCH)
            return original(obj, src, ext, cc_args, extra, pp_opts)

        compiler._compile = _compile
        super().build_extensions()


ARCH = target_arch()
ext = Pybind11Extension(
    "offload._C",
    sources(ARCH),
    depends=sorted(glob("csrc/*.h")) + IN_PYTHON_MODULE,  # an edited header or included source rebuilds it
    include_dirs=["csrc"],
    cxx_std=17,
    define_macros=[("OFFLOAD_VERSION", VERSION)],
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":  # (tools/arm_check.py reads the tables above without building)
    ParallelCompile("OFFLOAD_BUILD_JOBS", default=0).install()
    setup(version=VERSION, ext_modules=[ext], cmdclass={"build_ext": BuildExt})
