# setup.py: builds offload._C with pybind11 against no torch headers, no OpenMP runtime and no
# host-specific architecture flag. kernels_<isa>.cpp files get that ISA's flags and nothing else
# does; the best ISA the CPU supports is chosen at import (csrc/cpu_features.cpp).
import os
import re
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = re.search(r'__version__ = "([^"]+)"', open(os.path.join(HERE, "offload", "_version.py")).read()).group(1)

ISA_FLAGS = {
    "_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
                    "-Wno-maybe-uninitialized"],  # GCC 12 false positive in avx512fintrin.h,
}


# The Python-facing sources (argument conversion, GIL release, table checks, the per-row calls into
# torch's getters) are compiled as one translation unit, csrc/python_module.cpp, at -O3 like the rest:
# pybind11's headers cost ~6-7 s of compiler time per unit, so one unit instead of four saves ~20 s.
IN_PYTHON_MODULE = ["csrc/bindings.cpp", "csrc/aio_bindings.cpp", "csrc/moments_bindings.cpp", "csrc/rows.cpp"]
# The longest compiles first (~22, 22, 19 and 5 s on one core; ParallelCompile hands the files out in
# this order), so that on 2 cores the rest fills in around them instead of one of them starting last.
LONGEST_FIRST = ["csrc/kernels_avx2.cpp", "csrc/kernels_avx512.cpp", "csrc/python_module.cpp",
                 "csrc/kernels_scalar.cpp"]
SOURCES = LONGEST_FIRST + sorted(set(glob("csrc/*.cpp")) - set(IN_PYTHON_MODULE) - set(LONGEST_FIRST))


class BuildExt(build_ext):
    """Adds per-file flags: only csrc/kernels_<isa>.cpp is compiled for that ISA."""

    def build_extensions(self):
        compiler = self.compiler
        original = compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            extra = list(extra_postargs)
            for suffix, flags in ISA_FLAGS.items():
                if src.endswith(suffix):
                    extra += flags
            return original(obj, src, ext, cc_args, extra, pp_opts)

        compiler._compile = _compile
        super().build_extensions()


ext = Pybind11Extension(
    "offload._C",
    SOURCES,
    depends=sorted(glob("csrc/*.h")) + IN_PYTHON_MODULE,  # an edited header or included source rebuilds it
    include_dirs=["csrc"],
    cxx_std=17,
    define_macros=[("OFFLOAD_VERSION", VERSION)],
    # -ffp-contract=off: no silent FMA contraction, so every ISA path rounds exactly like the
    # scalar reference (bitwise-identical results; see csrc/simd.h).
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra"],
    extra_link_args=["-pthread"],
)

ParallelCompile("OFFLOAD_BUILD_JOBS", default=0).install()
setup(version=VERSION, ext_modules=[ext], cmdclass={"build_ext": BuildExt})
