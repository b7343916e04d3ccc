// kernels_sve256.cpp: the SVE kernels for CPUs whose vector length is 256 bits (kernels_sve.h).
// setup.py compiles it on aarch64 only, with -march=armv8-a+sve -msve-vector-bits=256.
#include "kernels_sve.h"
OFFLOAD_DEFINE_SVE(256)
