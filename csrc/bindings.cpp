// bindings.cpp: the Python module offload._C. Thin: converts the int64 task tables built by
// offload/native/adam.py into native structs, checks their shape, releases the GIL around every
// call that does real work, and maps std::invalid_argument to ValueError.
//
// What each Python-reachable entry trusts, and why:
// - _adam_step, _grad_sumsq, _bandwidth_probe(_moments), _fingerprint: take raw addresses (int64 tables / ints) and
//   dereference them. The native layer cannot know the extent of torch memory, so it checks only
//   what a table can tell (shape, dtype codes, lengths, nulls, overlap within a row) and TRUSTS
//   that every address range lies inside live memory. Hence they are private (underscore, not
//   documented) and called only from offload/native/adam.py: adam_step / grad_sumsq /
//   bandwidth_probe(_moments) / fingerprint there validate each tensor first (CPU, dtype, contiguous, storage bounds,
//   no neg/conj bit, no overlap between written buffers); _step_table runs tables that the
//   optimizer, the NVMe store and the GPU pipeline build from tensors they validated and keep
//   alive (their job to revalidate on change, e.g. with base/tensors.tensor_signature).
// - collect_rows (csrc/rows.cpp, the optimizer's fast path): reads the lists and arrays it is
//   given and compares pointers as integers; it never dereferences a tensor address. It holds strong
//   references across every call into Python (the getters it is given may run arbitrary code) and
//   re-checks the list sizes after each such call, raising RuntimeError if they changed. Public, but
//   only called by offload/params/hostrows.py.
// - AioEngine / AioFile (aio_bindings.cpp): no raw addresses: buffers come as buffer-protocol
//   objects whose export (pointer and length) is held until the transfer is waited for; files are
//   handles owning their descriptors. Usable only in the process that created the engine.
// - available_isas, get_isa, set_isa, get/set_stream_prefetch, affinity_cpu_count,
//   get/set_num_threads: plain values, range-checked.
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "adam.h"
#include "kernels.h"
#include "threadpool.h"

#ifndef OFFLOAD_VERSION
#error "OFFLOAD_VERSION must be defined by the build (setup.py)"
#endif
#define OFFLOAD_STR2(x) #x
#define OFFLOAD_STR(x) OFFLOAD_STR2(x)

namespace py = pybind11;
using namespace offload;

void register_aio(py::module_& m);  // csrc/aio_bindings.cpp (NVMe state I/O engine)
void register_moments(py::module_& m);  // csrc/moments_bindings.cpp (compressed moments)
void register_rows(py::module_& m);  // csrc/rows.cpp (the optimizer's per-step row check)

// Module attributes <prefix><name>: the column of each field of a task-table row, whose struct is
// 8-byte fields (pointers and int64): its byte offset / 8. The Python side builds its int64
// tables by these (offload/native/adam.py, offload/native/moments.py).
void export_columns(py::module_& m, const std::string& prefix,
                    std::initializer_list<std::pair<const char*, std::size_t>> fields) {
  for (const auto& f : fields)
    m.attr(py::str(prefix + f.first)) = static_cast<int64_t>(f.second / sizeof(int64_t));
}

namespace {

// A C-contiguous int64 table of shape (rows, cols); returns its rows as T*.
template <class T, int Cols>
const T* table_rows(const py::array& a, int64_t* rows, const char* what) {
  static_assert(sizeof(T) == Cols * sizeof(int64_t), "table row layout");
  if (!py::isinstance<py::array_t<int64_t>>(a) || a.dtype().kind() != 'i' || a.itemsize() != 8)
    throw std::invalid_argument(std::string(what) + " table must be an int64 array");
  if (a.ndim() != 2 || a.shape(1) != Cols)
    throw std::invalid_argument(std::string(what) + " table must have shape (n, " + std::to_string(Cols) + ")");
  if (!(a.flags() & py::array::c_style))
    throw std::invalid_argument(std::string(what) + " table must be C-contiguous");
  *rows = a.shape(0);
  return reinterpret_cast<const T*>(a.data());
}

AdamHyper hyper(double lr, double beta1, double beta2, double eps, double wd, bool decoupled,
                bool amsgrad, bool maximize, double grad_multiplier) {
  return AdamHyper{lr, beta1, beta2, eps, wd, grad_multiplier, decoupled, amsgrad, maximize};
}

int check_threads(int threads) {
  if (threads < 0 || threads > 1024) throw std::invalid_argument("threads must be in [0, 1024] (0 = pool size)");
  return threads == 0 ? pool_size() : threads;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "offload native core: vectorized CPU Adam, gradient statistics, thread pool";
  m.attr("__version__") = OFFLOAD_STR(OFFLOAD_VERSION);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  // the fp32-moment task table (AdamTask, common.h)
  static_assert(sizeof(AdamTask) == kTaskCols * sizeof(int64_t), "table row layout");
  m.attr("TASK_COLS") = kTaskCols;
  export_columns(m, "COL_",
                 {{"P", offsetof(AdamTask, p)}, {"M", offsetof(AdamTask, m)},
                  {"V", offsetof(AdamTask, v)}, {"VMAX", offsetof(AdamTask, vmax)},
                  {"G", offsetof(AdamTask, g)}, {"OUT", offsetof(AdamTask, out)},
                  {"N", offsetof(AdamTask, n)}, {"STEP", offsetof(AdamTask, step)},
                  {"GD", offsetof(AdamTask, gdtype)}, {"OD", offsetof(AdamTask, odtype)}});

  m.def("available_isas", &available_isas, "ISAs this CPU supports, best last.");
  m.def("get_isa", [] { return std::string(active_kernels().name); }, "ISA of the kernels in use.");
  m.def("set_isa", &set_isa, py::arg("name"),
        "Force an ISA ('scalar', 'avx2', 'avx512', 'neon', 'sve128', 'sve256', 'sve512' or 'auto'); "
        "ValueError if unsupported.");
  m.def("set_stream_prefetch", &set_stream_prefetch, py::arg("mode"),
        "Software prefetch in the fp32 update loop: 'on', 'off' or 'auto' (by CPU vendor).");
  m.def("get_stream_prefetch", [] { return py::make_tuple(stream_prefetch_mode(), stream_prefetch()); },
        "(setting, whether the fp32 loop prefetches now).");
  m.def("affinity_cpu_count", &affinity_cpu_count, "CPUs in this process's affinity mask.");
  m.def("get_num_threads", &pool_size, "Native thread pool size.");
  m.def("set_num_threads", &set_pool_size, py::arg("n"), "Resize the native thread pool.");

  m.def(
      "_adam_step",
      [](const py::array& table, double lr, double beta1, double beta2, double eps, double wd,
         bool decoupled, bool amsgrad, bool maximize, double grad_multiplier, int threads,
         bool reference) {
        int64_t rows = 0;
        const AdamTask* t = table_rows<AdamTask, kTaskCols>(table, &rows, "adam task");
        const AdamHyper h = hyper(lr, beta1, beta2, eps, wd, decoupled, amsgrad, maximize, grad_multiplier);
        const int nt = check_threads(threads);
        py::gil_scoped_release nogil;
        if (reference) adam_multi_reference(t, rows, h);
        else adam_multi(t, rows, h, nt);
      },
      py::arg("table"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("decoupled"), py::arg("amsgrad"), py::arg("maximize"),
      py::arg("grad_multiplier"), py::arg("threads") = 0, py::arg("reference") = false,
      "Adam/AdamW update of every tensor in an int64 table with rows "
      "(p, m, v, vmax, g, out, n, step, gdtype, odtype): columns COL_*. Internal: use "
      "offload.kernels.adam_step.");

  register_rows(m);  // csrc/rows.cpp: the optimizer's per-step row check (collect_rows)

  m.def(
      "_grad_sumsq",
      [](const py::array& table, int threads) {
        int64_t rows = 0;
        const GradTask* t = table_rows<GradTask, kGradCols>(table, &rows, "gradient");
        const int nt = check_threads(threads);
        py::gil_scoped_release nogil;
        return grad_sumsq(t, rows, nt);
      },
      py::arg("table"), py::arg("threads") = 0,
      "Sum of squares (float64) over gradients in an int64 table with rows (g, n, dtype).");

  m.def(
      "_bandwidth_probe",
      [](int64_t p, int64_t mm, int64_t v, int64_t g, int64_t n, int threads, int mode) {
        const int nt = check_threads(threads);
        py::gil_scoped_release nogil;
        bandwidth_probe(reinterpret_cast<float*>(p), reinterpret_cast<float*>(mm),
                        reinterpret_cast<float*>(v), reinterpret_cast<const float*>(g), n, nt, mode);
      },
      py::arg("p"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("n"), py::arg("threads") = 0,
      py::arg("mode") = 0,
      "Memory-bandwidth probe with Adam's access pattern (reads 4, writes 3 fp32 streams); mode: "
      "0 fused + software prefetch, 1 fused, hardware prefetch only, 2 threads on alternate tiles, "
      "3 one stream at a time in 16 KiB tiles.");
  m.attr("PROBE_MODES") = py::int_(kProbeModes);

  m.def(
      "_bandwidth_probe_moments",
      [](int64_t p, int64_t mm, int64_t v, int64_t g, int64_t out, int64_t n, int64_t mbytes, int64_t gbytes,
         int threads, int mode) {
        const int nt = check_threads(threads);
        py::gil_scoped_release nogil;
        bandwidth_probe_fmt(reinterpret_cast<float*>(p), reinterpret_cast<void*>(mm), reinterpret_cast<void*>(v),
                            reinterpret_cast<const void*>(g), reinterpret_cast<void*>(out), n, mbytes, gbytes, nt,
                            mode);
      },
      py::arg("p"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("out"), py::arg("n"), py::arg("mbytes"),
      py::arg("gbytes"), py::arg("threads") = 0, py::arg("mode") = 0,
      "Memory-bandwidth probe with a compressed-moment step's streams: fp32 p read+written, g read "
      "(gbytes 4 or 2), m and v read+written (mbytes 4, 2 or 1), out (2-byte, 0 = none) read+written; "
      "mode 0, 1 or 2 as _bandwidth_probe's.");

  m.def(
      "_fingerprint",
      [](int64_t ptr, int64_t nbytes) {
        if (nbytes < 0) throw std::invalid_argument("negative length");
        if (nbytes > 0 && ptr == 0) throw std::invalid_argument("null pointer");
        py::gil_scoped_release nogil;
        return fingerprint_bytes(reinterpret_cast<const void*>(ptr), nbytes);
      },
      py::arg("ptr"), py::arg("nbytes"),
      "Position-weighted sum (int64) of the 32-bit words at [ptr, ptr + nbytes): see "
      "offload/params/fingerprint.py. Raw address: called only from offload/native/adam.py.");

  m.def(
      "_debug_hold_pool_lock",
      [](double seconds) {
        if (!(seconds >= 0.0 && seconds <= 10.0)) throw std::invalid_argument("seconds must be in [0, 10]");
        py::gil_scoped_release nogil;
        debug_hold_pool_lock(seconds);
      },
      py::arg("seconds"), "Test hook: hold the thread pool's global lock (GIL released).");

  register_aio(m);  // csrc/aio_bindings.cpp
  register_moments(m);  // csrc/moments_bindings.cpp
}
