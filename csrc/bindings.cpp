// bindings.cpp: the Python module offload._C. Thin: converts the int64 task tables built by
// offload/_kernels.py into native structs, checks their shape, releases the GIL around every
// call that does real work, and maps std::invalid_argument to ValueError.
//
// What each Python-reachable entry trusts, and why (issue 10, item 14):
// - _adam_step, _grad_sumsq, _bandwidth_probe: take raw addresses (int64 tables / ints) and
//   dereference them. The native layer cannot know the extent of torch memory, so it checks only
//   what a table can tell (shape, dtype codes, lengths, nulls, overlap within a row) and TRUSTS
//   that every address range lies inside live memory. Hence they are private (underscore, not
//   documented) and called only from offload/_kernels.py: adam_step / grad_sumsq /
//   bandwidth_probe there validate each tensor first (CPU, dtype, contiguous, storage bounds,
//   no neg/conj bit, no overlap between written buffers); _step_table runs tables that the
//   optimizer, the NVMe store and the GPU pipeline build from tensors they validated and keep
//   alive (their job to revalidate on change, e.g. with _kernels.tensor_signature).
// - collect_grads: reads the lists and arrays it is given and compares pointers as integers; it
//   never dereferences an address. It holds strong references across every call into Python
//   (the descriptor and data_ptr callbacks may run arbitrary code) and re-checks the list sizes
//   after each such call, raising RuntimeError if they changed. Public, but still only called by
//   offload (_kernels.collect_grads). collect_rows (the optimizer's fast path) follows the same rules.
// - AioEngine / AioFile (aio_bindings.cpp): no raw addresses: buffers come as buffer-protocol
//   objects whose export (pointer and length) is held until the transfer is waited for; files are
//   handles owning their descriptors. Usable only in the process that created the engine.
// - available_isas, get_isa, set_isa, affinity_cpu_count, get/set_num_threads: plain values,
//   range-checked.
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <stdexcept>
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

// fn(tensor) where fn is the unbound TensorBase.data_ptr (vectorcall, no attribute lookup).
int64_t data_ptr(PyObject* tensor, PyObject* fn) {
  PyObject* r = PyObject_CallOneArg(fn, tensor);
  if (r == nullptr) throw py::error_already_set();
  const long long v = PyLong_AsLongLong(r);
  Py_DECREF(r);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return static_cast<int64_t>(v);
}

// 1-D pointer arrays: forced to C-contiguous int64 (a strided or other-typed array is copied).
using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

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

  m.def("available_isas", &available_isas, "ISAs this CPU supports, best last.");
  m.def("get_isa", [] { return std::string(active_kernels().name); }, "ISA of the kernels in use.");
  m.def("set_isa", &set_isa, py::arg("name"),
        "Force an ISA ('scalar', 'avx2', 'avx512' or 'auto'); ValueError if unsupported.");
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
      "(p, m, v, vmax, g, out, n, step, gdtype, odtype). Internal: use offload._kernels.");

  // Per-step gather for the optimizer (offload/optim.py, _GroupPlan): one C loop instead of a
  // Python loop over every parameter. Holds the GIL (it calls into Python objects). The `grad`
  // getset descriptor and the unbound `data_ptr` of torch's tensor base class are passed in, so
  // each access is a direct C call rather than an attribute lookup through the subclass MRO.
  // Both may run Python code (a tensor subclass's __torch_function__, or any callable passed
  // here) that mutates the lists: every object used across such a call is held by a strong
  // reference, and the list sizes are re-checked after each call before any slot is read.
  m.def(
      "collect_grads",
      [](const py::list& params, const py::list& cached_grads, const IntArray& p_ptrs, const IntArray& g_ptrs,
         const py::object& grad_descr, const py::object& data_ptr_fn) {
        const py::ssize_t n = PyList_GET_SIZE(params.ptr());
        if (PyList_GET_SIZE(cached_grads.ptr()) != n || p_ptrs.ndim() != 1 || g_ptrs.ndim() != 1 ||
            p_ptrs.shape(0) != n || g_ptrs.shape(0) != n)
          throw std::invalid_argument("collect_grads: lists and pointer arrays must have one entry per parameter");
        descrgetfunc get = Py_TYPE(grad_descr.ptr())->tp_descr_get;
        if (get == nullptr) throw std::invalid_argument("collect_grads: grad_descr is not a descriptor");
        // Copies: a callback cannot resize or free what is read below.
        std::vector<int64_t> pp(p_ptrs.data(), p_ptrs.data() + n), gp(g_ptrs.data(), g_ptrs.data() + n);
        auto check_sizes = [&] {
          if (PyList_GET_SIZE(params.ptr()) != n || PyList_GET_SIZE(cached_grads.ptr()) != n)
            throw std::runtime_error("collect_grads: the parameter list changed size during the call (a grad or "
                                     "data_ptr callback modified it)");
        };
        std::vector<int64_t> ready;
        py::list changed;
        ready.reserve(static_cast<size_t>(n));
        for (py::ssize_t i = 0; i < n; ++i) {
          check_sizes();
          const py::object p = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(params.ptr(), i));
          const py::object g = py::reinterpret_steal<py::object>(
              get(grad_descr.ptr(), p.ptr(), reinterpret_cast<PyObject*>(Py_TYPE(p.ptr()))));
          if (!g) throw py::error_already_set();
          if (g.is_none()) continue;
          bool same = data_ptr(p.ptr(), data_ptr_fn.ptr()) == pp[i];
          if (same) {
            check_sizes();  // identity only: the slot is compared, never dereferenced
            same = g.ptr() == PyList_GET_ITEM(cached_grads.ptr(), i) && data_ptr(g.ptr(), data_ptr_fn.ptr()) == gp[i];
          }
          if (same) ready.push_back(i);
          else changed.append(py::int_(i));
        }
        check_sizes();
        return py::make_tuple(py::array_t<int64_t>(ready.size(), ready.data()), changed);
      },
      py::arg("params"), py::arg("cached_grads"), py::arg("p_ptrs"), py::arg("g_ptrs"), py::arg("grad_descr"),
      py::arg("data_ptr_fn"),
      "Indices of parameters whose grad is set and whose param/grad pointers and grad object are "
      "unchanged since cached (ready), and of those that need re-validation in Python (changed). "
      "RuntimeError if a callback changes the size of either list.");

  // The optimizer's fast path (offload/optim.py, _AdamBase._collect): collect_grads plus every
  // per-row comparison that decides whether a row may be stepped without re-validation, in one
  // C loop. A row is ready only if its grad is set and ALL of these equal what was recorded when
  // the row was last validated: the grad object (g_refs[i] is a weakref to it; anything else
  // counts as "no validated grad"), the grad's data pointer and `_version`, the param's data
  // pointer, shape, strides and dtype (p_metas[i] = (ptr, shape, strides, dtype) as
  // _plan.fingerprint records it; `p.data = p.data.t()` keeps the pointer), and for rows with
  // lowp[i] the param's `_version` (a user write into a bf16/fp16 param must be re-read into the
  // master). Anything else goes to changed, where Python re-validates in full. fns is the tuple
  // (grad descriptor, unbound data_ptr, _version descriptor, shape descriptor, unbound stride,
  // dtype descriptor) of torch's TensorBase. Same safety rules as collect_grads: never
  // dereferences an address, holds strong references across every call into Python, re-checks
  // the list sizes after each.
  m.def(
      "collect_rows",
      [](const py::list& params, const py::list& g_refs, const IntArray& p_ptrs, const IntArray& g_ptrs,
         const IntArray& g_vers, const py::list& p_metas, const py::array_t<bool, py::array::c_style | py::array::forcecast>& lowp,
         const IntArray& p_vers, const py::tuple& fns) {
        const py::ssize_t n = PyList_GET_SIZE(params.ptr());
        auto one_per_param = [n](const py::array& a) { return a.ndim() == 1 && a.shape(0) == n; };
        if (PyList_GET_SIZE(g_refs.ptr()) != n || PyList_GET_SIZE(p_metas.ptr()) != n || !one_per_param(p_ptrs) ||
            !one_per_param(g_ptrs) || !one_per_param(g_vers) || !one_per_param(lowp) || !one_per_param(p_vers))
          throw std::invalid_argument("collect_rows: lists and arrays must have one entry per parameter");
        if (fns.size() != 6) throw std::invalid_argument("collect_rows: fns must hold 6 callables");
        const py::object grad_d = fns[0], ptr_fn = fns[1], ver_d = fns[2], shape_d = fns[3], stride_fn = fns[4],
                         dtype_d = fns[5];  // strong references for the whole call
        for (const py::object* d : {&grad_d, &ver_d, &shape_d, &dtype_d})
          if (Py_TYPE(d->ptr())->tp_descr_get == nullptr)
            throw std::invalid_argument("collect_rows: fns[0, 2, 3, 5] must be descriptors");
        // Copies: a callback cannot resize or free what is read below.
        const std::vector<int64_t> pp(p_ptrs.data(), p_ptrs.data() + n), gp(g_ptrs.data(), g_ptrs.data() + n),
            gv(g_vers.data(), g_vers.data() + n), pv(p_vers.data(), p_vers.data() + n);
        const std::vector<char> low(lowp.data(), lowp.data() + n);
        auto check_sizes = [&] {
          if (PyList_GET_SIZE(params.ptr()) != n || PyList_GET_SIZE(g_refs.ptr()) != n ||
              PyList_GET_SIZE(p_metas.ptr()) != n)
            throw std::runtime_error("collect_rows: the parameter list changed size during the call (a "
                                     "callback modified it)");
        };
        auto get = [](const py::object& descr, const py::object& obj) {
          PyObject* r = Py_TYPE(descr.ptr())->tp_descr_get(descr.ptr(), obj.ptr(),
                                                           reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())));
          if (r == nullptr) throw py::error_already_set();
          return py::reinterpret_steal<py::object>(r);
        };
        auto as_int = [](const py::object& o) {
          const long long v = PyLong_AsLongLong(o.ptr());
          if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
          return static_cast<int64_t>(v);
        };
        auto equal = [](const py::object& a, PyObject* b) {
          const int r = PyObject_RichCompareBool(a.ptr(), b, Py_EQ);
          if (r < 0) throw py::error_already_set();
          return r == 1;
        };
        std::vector<int64_t> ready;
        py::list changed;
        ready.reserve(static_cast<size_t>(n));
        for (py::ssize_t i = 0; i < n; ++i) {
          check_sizes();
          const py::object p = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(params.ptr(), i));
          const py::object g = get(grad_d, p);
          if (g.is_none()) continue;
          check_sizes();
          bool same = false;
          {
            const py::object ref = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(g_refs.ptr(), i));
            if (PyWeakref_CheckRef(ref.ptr())) {
              PyObject* target = PyWeakref_GetObject(ref.ptr());  // borrowed; compared at once, no call between
              if (target == nullptr) throw py::error_already_set();
              same = target == g.ptr();
            }
          }
          same = same && data_ptr(g.ptr(), ptr_fn.ptr()) == gp[i];
          same = same && as_int(get(ver_d, g)) == gv[i];
          same = same && data_ptr(p.ptr(), ptr_fn.ptr()) == pp[i];
          if (same) {
            check_sizes();
            const py::object meta = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(p_metas.ptr(), i));
            same = PyTuple_Check(meta.ptr()) && PyTuple_GET_SIZE(meta.ptr()) == 4;
            // meta is held strongly, and a tuple's items cannot change: safe across the calls below
            same = same && get(dtype_d, p).ptr() == PyTuple_GET_ITEM(meta.ptr(), 3);
            same = same && equal(get(shape_d, p), PyTuple_GET_ITEM(meta.ptr(), 1));
            if (same) {
              PyObject* s = PyObject_CallOneArg(stride_fn.ptr(), p.ptr());
              if (s == nullptr) throw py::error_already_set();
              same = equal(py::reinterpret_steal<py::object>(s), PyTuple_GET_ITEM(meta.ptr(), 2));
            }
          }
          same = same && (!low[i] || as_int(get(ver_d, p)) == pv[i]);
          if (same) ready.push_back(i);
          else changed.append(py::int_(i));
        }
        check_sizes();
        return py::make_tuple(py::array_t<int64_t>(ready.size(), ready.data()), changed);
      },
      py::arg("params"), py::arg("g_refs"), py::arg("p_ptrs"), py::arg("g_ptrs"), py::arg("g_vers"),
      py::arg("p_metas"), py::arg("lowp"), py::arg("p_vers"), py::arg("fns"),
      "(ready, changed): indices of parameters with a grad whose grad (object, pointer, version) and "
      "param (pointer, shape, strides, dtype; version where lowp) equal the recorded ones, and of those "
      "that need re-validation. RuntimeError if a callback changes the size of a list.");

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
      [](int64_t p, int64_t mm, int64_t v, int64_t g, int64_t n, int threads) {
        const int nt = check_threads(threads);
        py::gil_scoped_release nogil;
        bandwidth_probe(reinterpret_cast<float*>(p), reinterpret_cast<float*>(mm),
                        reinterpret_cast<float*>(v), reinterpret_cast<const float*>(g), n, nt);
      },
      py::arg("p"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("n"), py::arg("threads") = 0,
      "Memory-bandwidth probe with Adam's access pattern (reads 4, writes 3 fp32 streams).");

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
