// rows.cpp: _C.collect_rows, the per-step check of the optimizer's cached task table
// (offload/params/hostrows.py GroupRows; the record columns are offload/native/rows.py M_*).
//
// For every parameter row it decides, in one C loop, whether the row may be stepped as cached:
// - ready: the param and its grad are unchanged since the row was validated;
// - newgrad: the param is unchanged and its grad is a NEW plain CPU tensor that passed, here, every
//   check Python's check_tensor/check_storage make (the row's grad columns are updated here);
// - changed: anything else (param changed, a grad this loop does not take, no record): Python
//   revalidates the row in full and raises with the precise message where it must;
// - other: params that are not exactly torch.Tensor / torch.nn.Parameter (DTensor, subclasses):
//   Python handles them (their getters may mean something else).
//
// What "unchanged" compares, per tensor (the param, and the grad against the param's record):
// data pointer, dtype (identity of torch's cached dtype object), strides (exactly the validated,
// contiguous ones: they also fix dim), exact shape (size(0) for 1-D, the torch.Size above) and the
// neg bit (`.data = neg-view` keeps pointer, shape and strides); for bf16/fp16 params the param's
// `_version` (a user write must be re-read into the fp32 master). `t.data = x` keeps the tensor
// object and its version counter but may change every one of these, so each is read, for grads
// too. In-place value writes to a grad need no revalidation (the kernel reads the current values);
// every in-place METADATA change (t_, resize_, as_strided_, set_, unsqueeze_...) shows in the
// pointer, strides or shape. A storage resize_ reallocates (new pointer).
//
// collect_rows(..., grads=out) also stores each accepted row's grad object in out[i] (a list of n
// entries the caller made): the caller keeps exactly the gradients whose pointers are in the table.
//
// state_rows (the state engine's check of opt.state, offload/engine/torchstate.py) compares, for
// every row with state, opt.state.get(p) and the entries it was last validated with, by identity,
// and the data pointers of the recorded tensors: the rows that differ are revalidated in Python.
//
// The getters are called through their C slots (a getset descriptor's tp_descr_get, vectorcall on
// the unbound method), which are passed in `fns` so that tests can pass callbacks. Safety rules
// (csrc/bindings.cpp header): never dereferences a tensor address; every object used across a call
// into Python is held by a strong reference; the list sizes are re-checked after each such call.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <vector>

namespace py = pybind11;

namespace {

// columns of the per-row record (offload/native/rows.py M_* must match)
enum : int64_t { R_PPTR, R_GPTR, R_CODE, R_DIM, R_SIZE0, R_NUMEL, R_PVER, R_LOWP, R_COLS };
constexpr int64_t kTableCols = 10, kTableColG = 4, kTableColGD = 8;  // offload/native/adam.py COL_G, COL_GD

using Table = py::array_t<int64_t, py::array::c_style>;

int64_t* table_data(const py::array& a, py::ssize_t rows, py::ssize_t cols, const char* what) {
  if (!py::isinstance<py::array_t<int64_t>>(a) || a.dtype().kind() != 'i' || a.itemsize() != 8 || a.ndim() != 2 ||
      a.shape(0) != rows || a.shape(1) != cols || !(a.flags() & py::array::c_style) || !a.writeable())
    throw std::invalid_argument(std::string("collect_rows: ") + what + " must be a writable C-contiguous int64 array of shape (" +
                                std::to_string(rows) + ", " + std::to_string(cols) + ")");
  return static_cast<int64_t*>(const_cast<void*>(a.data()));
}

// The callables/constants of torch that the loop uses, borrowed from the `fns` tuple (held by the caller).
struct Torch {
  PyObject *grad, *data_ptr, *dtype, *stride, *is_neg, *is_conj, *version, *shape, *is_cpu, *layout,
      *storage_offset, *untyped_storage, *storage_nbytes, *tensor_t, *param_t, *strided;
  PyObject* dtypes[4];  // by dtype code: -, float32, bfloat16, float16
  lenfunc size0;        // TensorBase's mp_length: size(0), no allocation
};

constexpr int kFns = 20;

Torch unpack(const py::tuple& fns) {
  if (fns.size() != kFns) throw std::invalid_argument("collect_rows: fns must hold " + std::to_string(kFns) + " entries");
  auto at = [&](int k) { return PyTuple_GET_ITEM(fns.ptr(), k); };
  Torch t{};
  PyObject** slots[] = {&t.grad, &t.data_ptr, &t.dtype, &t.stride, &t.is_neg, &t.is_conj, &t.version, &t.shape,
                        &t.is_cpu, &t.layout, &t.storage_offset, &t.untyped_storage, &t.storage_nbytes,
                        &t.tensor_t, &t.param_t, &t.strided};
  for (int k = 0; k < 16; ++k) *slots[k] = at(k);
  for (PyObject* d : {t.grad, t.dtype, t.version, t.shape, t.is_cpu, t.layout})
    if (Py_TYPE(d)->tp_descr_get == nullptr) throw std::invalid_argument("collect_rows: fns[grad, dtype, _version, shape, is_cpu, layout] must be descriptors");
  if (!PyType_Check(t.tensor_t) || !PyType_Check(t.param_t)) throw std::invalid_argument("collect_rows: fns[13, 14] must be types");
  t.dtypes[0] = nullptr;
  for (int k = 0; k < 3; ++k) t.dtypes[k + 1] = at(16 + k);
  PyObject* base = at(19);
  if (!PyType_Check(base) || reinterpret_cast<PyTypeObject*>(base)->tp_as_mapping == nullptr ||
      reinterpret_cast<PyTypeObject*>(base)->tp_as_mapping->mp_length == nullptr ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(t.tensor_t), reinterpret_cast<PyTypeObject*>(base)) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(t.param_t), reinterpret_cast<PyTypeObject*>(base)))
    throw std::invalid_argument("collect_rows: fns[19] must be torch's tensor base type");
  t.size0 = reinterpret_cast<PyTypeObject*>(base)->tp_as_mapping->mp_length;
  return t;
}

py::object get(PyObject* descr, PyObject* obj) {
  PyObject* r = Py_TYPE(descr)->tp_descr_get(descr, obj, reinterpret_cast<PyObject*>(Py_TYPE(obj)));
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

py::object call(PyObject* fn, PyObject* obj) {
  PyObject* r = PyObject_CallOneArg(fn, obj);
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

int64_t as_int(const py::object& o) {
  const long long v = PyLong_AsLongLong(o.ptr());
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return static_cast<int64_t>(v);
}

bool truth(const py::object& o) {
  if (o.ptr() == Py_True) return true;
  if (o.ptr() == Py_False) return false;
  const int r = PyObject_IsTrue(o.ptr());
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

// Does tensor t still match row record r and layout = (torch.Size, strides) of the validated param
// (pointer compared by the caller)? Dtype, strides (exactly the validated contiguous ones), exact
// shape (the strides give dim; size(0) fixes a 1-D shape, above 1-D the torch.Size is compared), no
// neg bit. Five calls into torch: each one costs more than everything else done here.
bool same_layout(const Torch& T, PyObject* t, const int64_t* r, PyObject* layout) {
  if (get(T.dtype, t).ptr() != T.dtypes[r[R_CODE]]) return false;
  if (!PyTuple_Check(layout) || PyTuple_GET_SIZE(layout) != 2) return false;
  const int eq = PyObject_RichCompareBool(call(T.stride, t).ptr(), PyTuple_GET_ITEM(layout, 1), Py_EQ);
  if (eq < 0) throw py::error_already_set();
  if (eq != 1) return false;
  if (r[R_DIM] <= 1) {  // dim equal (strides compared): 1-D size(0) is the shape; 0-D has none
    const Py_ssize_t s0 = T.size0(t);
    if (s0 < 0) throw py::error_already_set();
    if (s0 != r[R_SIZE0]) return false;
  } else {
    const int same = PyObject_RichCompareBool(get(T.shape, t).ptr(), PyTuple_GET_ITEM(layout, 0), Py_EQ);
    if (same < 0) throw py::error_already_set();
    if (same != 1) return false;
  }
  return !truth(call(T.is_neg, t));
}


// d[key] with the key's hash known (-1: computed, which may call Python), borrowed; nullptr when absent.
PyObject* lookup(PyObject* d, PyObject* key, int64_t hash) {
  PyObject* v;
#if PY_VERSION_HEX < 0x030D0000
  v = hash == -1 ? PyDict_GetItemWithError(d, key) : _PyDict_GetItem_KnownHash(d, key, static_cast<Py_hash_t>(hash));
#else
  (void)hash;
  v = PyDict_GetItemWithError(d, key);
#endif
  if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// state_rows(state, params, ready, recs, keys, ptrs, fns[, hashes]): rows i with ready[i] whose opt.state entry
// differs from what recs[i] recorded. recs[i] = (outer, inner, want_0 .. want_{K-1}): outer is
// state.get(params[i]) as validated (compared by identity), inner the plain dict that holds its
// entries (outer itself, or the dict inside the engine's CompressedState); want_j the object
// inner[keys[j]] was (None: absent or None; fns[1]: not compared), and ptrs[i, j] its data_ptr()
// (-1: not compared). A row whose record is not such a tuple is reported. state must be a dict
// (exact dict or defaultdict: the caller checks, .get of a subclass may differ); looking a parameter
// up runs its __hash__ (Python), so every object used afterwards is held and sizes are re-checked.
py::array_t<int64_t> state_rows(const py::object& state, const py::list& params, const py::array& ready_a,
                                const py::list& recs, const py::tuple& keys, const py::array& ptrs_a,
                                const py::tuple& fns, const py::object& hashes_a) {
  if (!PyDict_Check(state.ptr())) throw std::invalid_argument("state_rows: state must be a dict");
  const py::ssize_t n = PyList_GET_SIZE(params.ptr());
  const py::ssize_t k = PyTuple_GET_SIZE(keys.ptr());
  if (PyList_GET_SIZE(recs.ptr()) != n) throw std::invalid_argument("state_rows: recs must have one entry per parameter");
  for (py::ssize_t j = 0; j < k; ++j)
    if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(keys.ptr(), j))) throw std::invalid_argument("state_rows: keys must be str");
  if (!py::isinstance<py::array_t<bool>>(ready_a) || ready_a.dtype().kind() != 'b' || ready_a.itemsize() != 1 ||
      ready_a.ndim() != 1 || ready_a.shape(0) != n || !(ready_a.flags() & py::array::c_style))
    throw std::invalid_argument("state_rows: ready must be a C-contiguous bool array with one entry per parameter");
  const int64_t* want_ptr = table_data(ptrs_a, n, k, "ptrs");
  // hashes[i]: hash(params[i]) as recorded (-1: unknown). A dict key's hash never changes while it
  // is a key, so the lookup needs no call of the parameter's __hash__ (a Python function for torch
  // tensors): a warm step runs no Python per parameter.
  const int64_t* hashes = nullptr;
  if (!hashes_a.is_none()) {
    const py::array h = py::reinterpret_borrow<py::array>(hashes_a);
    if (!py::isinstance<py::array_t<int64_t>>(h) || h.dtype().kind() != 'i' || h.itemsize() != 8 || h.ndim() != 1 ||
        h.shape(0) != n || !(h.flags() & py::array::c_style))
      throw std::invalid_argument("state_rows: hashes must be a C-contiguous int64 array with one entry per parameter");
    hashes = static_cast<const int64_t*>(h.data());
  }
  const py::object hold_hashes = hashes_a;
  const bool* ready = static_cast<const bool*>(ready_a.data());
  if (fns.size() != 2) throw std::invalid_argument("state_rows: fns must be (data_ptr, skip)");
  PyObject* data_ptr = PyTuple_GET_ITEM(fns.ptr(), 0);
  PyObject* skip = PyTuple_GET_ITEM(fns.ptr(), 1);
  const py::object hold_ready = ready_a, hold_ptrs = ptrs_a, hold_state = state;
  auto check_sizes = [&] {
    if (PyList_GET_SIZE(params.ptr()) != n || PyList_GET_SIZE(recs.ptr()) != n)
      throw std::runtime_error("state_rows: the parameter list changed size during the call (a callback modified it)");
  };
  std::vector<int64_t> changed;
  for (py::ssize_t i = 0; i < n; ++i) {
    check_sizes();
    if (!ready[i]) continue;
    const py::object p = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(params.ptr(), i));
    const py::object rec = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(recs.ptr(), i));
    if (!PyTuple_CheckExact(rec.ptr()) || PyTuple_GET_SIZE(rec.ptr()) != 2 + k) {
      changed.push_back(i);
      continue;
    }
    PyObject* d = lookup(state.ptr(), p.ptr(), hashes ? hashes[i] : -1);  // borrowed: compared at once
    if (d == nullptr && PyErr_Occurred()) throw py::error_already_set();
    PyObject* inner = PyTuple_GET_ITEM(rec.ptr(), 1);  // held by rec
    if (d == nullptr || d != PyTuple_GET_ITEM(rec.ptr(), 0) || !PyDict_CheckExact(inner)) {
      changed.push_back(i);
      continue;
    }
    bool same = true;
    for (py::ssize_t j = 0; same && j < k; ++j) {
      PyObject* want = PyTuple_GET_ITEM(rec.ptr(), 2 + j);  // held by rec
      if (want == skip) continue;
      PyObject* v = PyDict_GetItemWithError(inner, PyTuple_GET_ITEM(keys.ptr(), j));  // borrowed, compared at once
      if (v == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        v = Py_None;
      }
      if (v != want) {
        same = false;
        break;
      }
      const int64_t ptr = want_ptr[i * k + j];
      if (ptr != -1) {
        const py::object w = py::reinterpret_borrow<py::object>(want);
        same = as_int(call(data_ptr, w.ptr())) == ptr;
        check_sizes();
      }
    }
    if (!same) changed.push_back(i);
  }
  check_sizes();
  return py::array_t<int64_t>(changed.size(), changed.data());
}

void register_state_rows(py::module_& m) {
  m.def("state_rows", &state_rows, py::arg("state"), py::arg("params"), py::arg("ready"), py::arg("recs"),
        py::arg("keys"), py::arg("ptrs"), py::arg("fns"), py::arg("hashes") = py::none(),
        "Row indices (with ready[i]) whose opt.state entry is not the one recorded in recs (identity of "
        "the state dict and of its entries, data pointers of its tensors): to revalidate in Python. "
        "Internal: offload/engine/torchstate.py. RuntimeError if a callback changes the size of a list.");
}

}  // namespace

void register_rows(py::module_& m) {
  m.def(
      "collect_rows",
      [](const py::list& params, const py::list& g_refs, const py::array& rec_a, const py::list& layouts,
         const py::array& table_a, const py::tuple& fns, const py::object& grads) {
        const py::ssize_t n = PyList_GET_SIZE(params.ptr());
        if (PyList_GET_SIZE(g_refs.ptr()) != n || PyList_GET_SIZE(layouts.ptr()) != n)
          throw std::invalid_argument("collect_rows: lists and arrays must have one entry per parameter");
        const bool out = !grads.is_none();
        if (out && (!PyList_CheckExact(grads.ptr()) || PyList_GET_SIZE(grads.ptr()) != n))
          throw std::invalid_argument("collect_rows: grads must be None or a list with one entry per parameter");
        int64_t* rec = table_data(rec_a, n, R_COLS, "rec");
        int64_t* table = table_data(table_a, n, kTableCols, "table");
        const Torch T = unpack(fns);
        // rec and table are written below, between calls into Python: hold the arrays themselves
        // (their buffers cannot be freed or moved while referenced and not resizable) ...
        const py::object hold_rec = rec_a, hold_table = table_a;
        auto check_sizes = [&] {
          if (PyList_GET_SIZE(params.ptr()) != n || PyList_GET_SIZE(g_refs.ptr()) != n ||
              PyList_GET_SIZE(layouts.ptr()) != n || (out && PyList_GET_SIZE(grads.ptr()) != n))
            throw std::runtime_error("collect_rows: the parameter list changed size during the call (a "
                                     "callback modified it)");
        };
        std::vector<int64_t> ready, newgrad, changed, other;
        ready.reserve(static_cast<size_t>(n));
        for (py::ssize_t i = 0; i < n; ++i) {
          check_sizes();
          py::object old_grad;  // a replaced grads[i]: released at the end of the iteration (may run code)
          auto keep_grad = [&](const py::object& g) {
            if (!out) return;
            check_sizes();
            old_grad = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(grads.ptr(), i));
            PyList_SetItem(grads.ptr(), i, g.inc_ref().ptr());  // steals the new reference
          };
          int64_t* r = rec + i * R_COLS;
          const py::object p = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(params.ptr(), i));
          PyObject* pt = reinterpret_cast<PyObject*>(Py_TYPE(p.ptr()));
          if (pt != T.tensor_t && pt != T.param_t) {
            other.push_back(i);
            continue;
          }
          const py::object g = get(T.grad, p.ptr());
          if (g.is_none()) continue;
          check_sizes();
          bool same_grad = false;
          {
            const py::object ref = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(g_refs.ptr(), i));
            if (PyWeakref_CheckRef(ref.ptr())) {
              PyObject* target = PyWeakref_GetObject(ref.ptr());  // borrowed; compared at once, no call between
              if (target == nullptr) throw py::error_already_set();
              same_grad = target == g.ptr();
            }
          }
          // the param: its record (code 0 / pointer -1: none yet) and everything in it
          const int64_t code = r[R_CODE];
          bool ok = code >= 1 && code <= 3 && r[R_PPTR] != -1 && as_int(call(T.data_ptr, p.ptr())) == r[R_PPTR];
          check_sizes();
          const py::object layout = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(layouts.ptr(), i));
          ok = ok && same_layout(T, p.ptr(), r, layout.ptr());
          ok = ok && (!r[R_LOWP] || as_int(get(T.version, p.ptr())) == r[R_PVER]);
          if (!ok) {
            changed.push_back(i);
            continue;
          }
          if (same_grad) {
            if (as_int(call(T.data_ptr, g.ptr())) == r[R_GPTR] && same_layout(T, g.ptr(), r, layout.ptr())) {
              keep_grad(g);
              ready.push_back(i);
            } else
              changed.push_back(i);
            continue;
          }
          // a new grad object: everything check_tensor(g, dtypes=(p.dtype,), shape=p.shape) and
          // check_storage(g) verify, or the Python path (which raises the right message)
          if (reinterpret_cast<PyObject*>(Py_TYPE(g.ptr())) != T.tensor_t || !truth(get(T.is_cpu, g.ptr())) ||
              get(T.layout, g.ptr()).ptr() != T.strided || !same_layout(T, g.ptr(), r, layout.ptr()) ||
              truth(call(T.is_conj, g.ptr()))) {
            changed.push_back(i);
            continue;
          }
          const int64_t numel = r[R_NUMEL];
          if (numel > 0) {  // the elements must lie inside the grad's storage
            const int64_t esize = code == 1 ? 4 : 2;
            const int64_t off = as_int(call(T.storage_offset, g.ptr()));
            const py::object st = call(T.untyped_storage, g.ptr());
            const int64_t nbytes = as_int(call(T.storage_nbytes, st.ptr()));
            if (off < 0 || off > (INT64_MAX / esize) - numel || (off + numel) * esize > nbytes) {
              changed.push_back(i);
              continue;
            }
          }
          const int64_t gptr = as_int(call(T.data_ptr, g.ptr()));
          PyObject* wr = PyWeakref_NewRef(g.ptr(), nullptr);
          if (wr == nullptr) throw py::error_already_set();
          check_sizes();
          // the replaced item is released only at the end of this iteration, after the last use of
          // anything borrowed (releasing it may run arbitrary code: the next iteration re-checks)
          const py::object old_ref = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(g_refs.ptr(), i));
          PyList_SetItem(g_refs.ptr(), i, wr);  // steals wr
          r[R_GPTR] = gptr;
          table[i * kTableCols + kTableColG] = numel > 0 ? gptr : 0;
          table[i * kTableCols + kTableColGD] = code;
          keep_grad(g);
          newgrad.push_back(i);
        }
        check_sizes();
        auto arr = [](const std::vector<int64_t>& v) { return py::array_t<int64_t>(v.size(), v.data()); };
        return py::make_tuple(arr(ready), arr(newgrad), arr(changed), arr(other));
      },
      py::arg("params"), py::arg("g_refs"), py::arg("rec"), py::arg("layouts"), py::arg("table"), py::arg("fns"),
      py::arg("grads") = py::none(),
      "(ready, newgrad, changed, other): row indices of params with a grad, unchanged since validated "
      "(ready); unchanged param with a new grad validated here, grad columns updated (newgrad); to "
      "revalidate in Python (changed); params of other types (other, grad not read). grads (optional "
      "list): receives the grad of every ready and newgrad row. Internal: "
      "offload/params/hostrows.py. RuntimeError if a callback changes the size of a list.");
  register_state_rows(m);
}
