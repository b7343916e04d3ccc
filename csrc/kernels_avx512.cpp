// kernels_avx512.cpp: instantiates the kernels of kernels_impl.h for the avx512 instruction set.
// setup.py compiles this file alone with the flags of that ISA; nothing else in the build
// uses them, so the module still loads on CPUs without it (dispatch in cpu_features.cpp).
#include "kernels_impl.h"
OFFLOAD_DEFINE_ISA(avx512, Avx512ISA)
