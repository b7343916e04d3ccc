// kernels_sve512.cpp: the SVE kernels for CPUs whose vector length is 512 bits (kernels_sve.h).
// setup.py compiles it on aarch64 only, with -march=armv8-a+sve -msve-vector-bits=512.
#include "kernels_sve.h"
OFFLOAD_DEFINE_SVE(512)
