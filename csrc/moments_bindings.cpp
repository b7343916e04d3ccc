// moments_bindings.cpp: the Python entry of the compressed-moment Adam (moments.h), registered
// into offload._C by bindings.cpp. Same conventions as adam_step: an int64 task table (rows of
// kQTaskCols), hyperparameters as floats, the GIL released around the work, std::invalid_argument
// mapped to ValueError (by the module's translator).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <stdexcept>
#include <string>

#include "moments.h"
#include "threadpool.h"

namespace py = pybind11;
using namespace offload;

namespace {
// The column of a field of AdamQTask (8-byte fields: pointers and int64). Its own name: this file
// shares one translation unit with bindings.cpp (python_module.cpp).
constexpr int64_t moment_column(std::size_t offset) {
  return static_cast<int64_t>(offset / sizeof(int64_t));
}
}  // namespace

void register_moments(py::module_& m) {
  // columns of the compressed-moment task table (AdamQTask, moments.h), for native/moments.py
  m.attr("MOMENT_TASK_COLS") = kQTaskCols;
  m.attr("MOMENT_COL_P") = moment_column(offsetof(AdamQTask, p));
  m.attr("MOMENT_COL_M") = moment_column(offsetof(AdamQTask, m));
  m.attr("MOMENT_COL_V") = moment_column(offsetof(AdamQTask, v));
  m.attr("MOMENT_COL_M_SCALE") = moment_column(offsetof(AdamQTask, m_scale));
  m.attr("MOMENT_COL_V_SCALE") = moment_column(offsetof(AdamQTask, v_scale));
  m.attr("MOMENT_COL_G") = moment_column(offsetof(AdamQTask, g));
  m.attr("MOMENT_COL_OUT") = moment_column(offsetof(AdamQTask, out));
  m.attr("MOMENT_COL_N") = moment_column(offsetof(AdamQTask, n));
  m.attr("MOMENT_COL_STEP") = moment_column(offsetof(AdamQTask, step));
  m.attr("MOMENT_COL_GD") = moment_column(offsetof(AdamQTask, gdtype));
  m.attr("MOMENT_COL_OD") = moment_column(offsetof(AdamQTask, odtype));
  m.attr("MOMENT_COL_FMT") = moment_column(offsetof(AdamQTask, mfmt));
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
