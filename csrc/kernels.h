// kernels.h: the per-ISA kernel table and runtime CPU-feature dispatch.
// Each kernels_<isa>.cpp fills one IsaKernels; select_isa() picks one at run time.
#pragma once
#include "common.h"
#include "moments.h"
#include <string>
#include <vector>

namespace offload {

struct IsaKernels {
  const char* name;
  // Adam update of elements [begin, end) of one tensor.
  void (*adam_range)(const AdamTask&, const AdamScalars&, int64_t begin, int64_t end);
  // Sum of squares (double) of elements [begin, end) of a gradient of the given dtype.
  double (*sumsq)(const void* g, int64_t dtype, int64_t begin, int64_t end);
  // Bandwidth probe over [begin, end) in one of the access modes of kProbeModes (adam.h).
  void (*probe)(float* p, float* m, float* v, const float* g, int64_t begin, int64_t end, int mode);
  // Adam update over compressed moments (moments.h), blocks [block_begin, block_end) of one tensor.
  void (*adam_q_range)(const AdamQTask&, const AdamScalars&, int64_t block_begin, int64_t block_end);
  // Bandwidth probe over [begin, end) with a compressed-moment step's streams: m/v elements of
  // mbytes (1, 2, 4), gradient elements of gbytes (2, 4), out (2-byte) read and written if not
  // null; with software prefetch or not.
  void (*probe_fmt)(float* p, void* m, void* v, const void* g, void* out, int64_t mbytes, int64_t gbytes,
                    int64_t begin, int64_t end, bool prefetch);
};

extern const IsaKernels kernels_scalar;
extern const IsaKernels kernels_avx2;
extern const IsaKernels kernels_avx512;
// aarch64 (compiled there only): NEON, and SVE for one vector length each (kernels_sve.h)
extern const IsaKernels kernels_neon;
extern const IsaKernels kernels_sve128;
extern const IsaKernels kernels_sve256;
extern const IsaKernels kernels_sve512;

// ISAs this CPU (and OS) supports, best last: always starts with "scalar".
std::vector<std::string> available_isas();
// The kernels in use. Defaults to the best available.
const IsaKernels& active_kernels();
// Force an ISA by name; throws std::invalid_argument if unknown or unsupported here.
void set_isa(const std::string& name);

// Whether the fp32 update loop issues software prefetches (the compressed-moment loops always do).
// "auto" (the default) decides by CPU: on in Intel cores, whose hardware prefetchers alone left the
// fp32 step at 90-93 % of the memory's best; off in AMD cores, where a walk with the hardware
// prefetchers alone was 10-20 % faster than the same walk with software prefetches (Zen 3) and the
// step 3 % faster without them (median of 16 paired cells; -3 to +9 %). docs/benchmarks.md.
bool stream_prefetch();
// "on", "off" or "auto"; throws std::invalid_argument otherwise.
void set_stream_prefetch(const std::string& mode);
// The setting as given ("on", "off", "auto").
std::string stream_prefetch_mode();

// Plain scalar reference Adam (adam_reference.cpp): deliberately simple, used by tests.
void adam_reference(const AdamTask& t, const AdamHyper& h);

}  // namespace offload
