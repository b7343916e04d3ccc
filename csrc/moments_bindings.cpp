// moments_bindings.cpp: the Python entry of the compressed-moment Adam (moments.h), registered
// into offload._C by bindings.cpp. Same conventions as adam_step: an int64 task table (rows of
// kQTaskCols), hyperparameters as floats, the GIL released around the work, std::invalid_argument
// mapped to ValueError (by the module's translator).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>

#include "moments.h"
#include "threadpool.h"

namespace py = pybind11;
using namespace offload;

// (csrc/bindings.cpp) module attributes <prefix><name>: the column of each field of a table row
void export_columns(py::module_& m, const std::string& prefix,
                    std::initializer_list<std::pair<const char*, std::size_t>> fields);

void register_moments(py::module_& m) {
  // the compressed-moment task table (AdamQTask, moments.h), for offload/native/moments.py
  static_assert(sizeof(AdamQTask) == kQTaskCols * sizeof(int64_t), "table row layout");
  m.attr("MOMENT_TASK_COLS") = kQTaskCols;
  export_columns(m, "MOMENT_COL_",
                 {{"P", offsetof(AdamQTask, p)}, {"M", offsetof(AdamQTask, m)},
                  {"V", offsetof(AdamQTask, v)}, {"M_SCALE", offsetof(AdamQTask, m_scale)},
                  {"V_SCALE", offsetof(AdamQTask, v_scale)}, {"G", offsetof(AdamQTask, g)},
                  {"OUT", offsetof(AdamQTask, out)}, {"N", offsetof(AdamQTask, n)},
                  {"STEP", offsetof(AdamQTask, step)}, {"GD", offsetof(AdamQTask, gdtype)},
                  {"OD", offsetof(AdamQTask, odtype)}, {"FMT", offsetof(AdamQTask, mfmt)}});
  // the codes of the mfmt column (MomentFormat, moments.h) and the 8-bit format's block
  m.attr("MOMENT_CODE_BF16") = static_cast<int64_t>(kMomBF16);
  m.attr("MOMENT_CODE_8BIT") = static_cast<int64_t>(kMom8);
  m.attr("MOMENT_BLOCK") = kQBlock;
  m.def(
      "_adam_step_moments",
      [](const py::array& table, double lr, double beta1, double beta2, double eps, double wd, bool decoupled,
         bool amsgrad, bool maximize, double grad_multiplier, int threads, bool reference) {
        static_assert(sizeof(AdamQTask) == kQTaskCols * sizeof(int64_t), "table row layout");
        if (!py::isinstance<py::array_t<int64_t>>(table) || table.dtype().kind() != 'i' || table.itemsize() != 8)
          throw std::invalid_argument("moment task table must be an int64 array");
        if (table.ndim() != 2 || table.shape(1) != kQTaskCols)
          throw std::invalid_argument("moment task table must have shape (n, " + std::to_string(kQTaskCols) + ")");
        if (!(table.flags() & py::array::c_style)) throw std::invalid_argument("moment task table must be C-contiguous");
        if (threads < 0 || threads > 1024) throw std::invalid_argument("threads must be in [0, 1024] (0 = pool size)");
        const int nt = threads == 0 ? pool_size() : threads;
        const auto* t = reinterpret_cast<const AdamQTask*>(table.data());
        const int64_t rows = table.shape(0);
        const AdamHyper h{lr, beta1, beta2, eps, wd, grad_multiplier, decoupled, amsgrad, maximize};
        py::gil_scoped_release nogil;
        if (reference) adam_multi_moments_reference(t, rows, h);
        else adam_multi_moments(t, rows, h, nt);
      },
      py::arg("table"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
      py::arg("decoupled"), py::arg("amsgrad"), py::arg("maximize"), py::arg("grad_multiplier"),
      py::arg("threads") = 0, py::arg("reference") = false,
      "Adam/AdamW over compressed moments: int64 table rows (p, m, v, m_scale, v_scale, g, out, n, step, "
      "gdtype, odtype, mfmt), mfmt 2 = bf16, 8 = 8bit blockwise (csrc/moments.h). Internal: use "
      "offload.kernels.adam_step_moments.");
}
