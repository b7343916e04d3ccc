// kernels_neon.cpp: instantiates the kernels of kernels_impl.h for the neon instruction set
// (aarch64 Advanced SIMD, every aarch64 CPU has it). setup.py compiles it on aarch64 only and
// with no extra flag: the aarch64 baseline is this ISA (dispatch in cpu_features.cpp).
#include "kernels_impl.h"
OFFLOAD_DEFINE_ISA(neon, NeonISA)
