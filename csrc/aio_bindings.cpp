// aio_bindings.cpp: Python binding of the async I/O engine (offload._C.AioEngine, offload._C.AioFile),
// registered into offload._C by register_aio(). The validated, tensor-level API is offload/native/aio.py.
//
// What these entries trust (see also the table at the top of bindings.cpp): nothing that is a raw
// integer. A transfer names its memory as an object exporting the buffer protocol (a numpy array,
// bytearray, mmap, memoryview); the length is checked against the exported length, a read needs a
// writable export, and the export is held (keeping the memory alive and, for numpy/bytearray/mmap,
// un-resizable and un-closable) until the request has been waited for or the engine is gone. Files
// are AioFile handles that own their descriptors (closed only after the last transfer using them).
// The GIL is released while waiting.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "aio.h"

namespace py = pybind11;
using offload::aio::Engine;
using offload::aio::File;
using offload::aio::Result;
using offload::aio::Stats;

namespace {

// A held buffer export; released with the GIL held (every owner below runs with the GIL).
struct Export {
  Py_buffer view{};
  bool held = false;
  Export() = default;
  Export(const Export&) = delete;
  Export& operator=(const Export&) = delete;
  ~Export() {
    if (held) PyBuffer_Release(&view);
  }
};

// The engine plus the buffer exports of its unfinished requests. Every method runs with the GIL
// held (pybind11 holds it on entry), which guards `exports_`.
class PyEngine {
 public:
  PyEngine(int queue_depth, int64_t block_size) : eng_(new Engine(queue_depth, block_size)) {}
  ~PyEngine() {
    eng_.reset();      // parent: every queued piece finishes first; forked child: leaked, nothing runs
    exports_.clear();  // only now may the buffers go
  }

  int64_t submit(int op, const std::shared_ptr<File>& file, const py::object& buffer, std::optional<int64_t> length,
                 int64_t offset) {
    if (op != offload::aio::kRead && op != offload::aio::kWrite)
      throw std::invalid_argument("op must be 0 (read) or 1 (write)");
    if (!file) throw std::invalid_argument("file must be an AioFile");
    if (!PyObject_CheckBuffer(buffer.ptr()))
      throw py::type_error("buffer must support the buffer protocol (numpy array, bytearray, mmap, memoryview), "
                           "got " + std::string(py::str(py::type::of(buffer).attr("__name__"))) +
                           "; raw addresses are not accepted");
    auto ex = std::make_unique<Export>();
    const int flags = PyBUF_C_CONTIGUOUS | (op == offload::aio::kRead ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(buffer.ptr(), &ex->view, flags) != 0) throw py::error_already_set();
    ex->held = true;
    const int64_t avail = static_cast<int64_t>(ex->view.len);
    const int64_t len = length.value_or(avail);
    if (len < 0 || len > avail)
      throw std::invalid_argument("length " + std::to_string(len) + " out of range for a buffer of " +
                                  std::to_string(avail) + " bytes");
    const int64_t id = eng_->submit(op, file, ex->view.buf, len, offset);
    exports_.emplace(id, std::move(ex));
    return id;
  }

  bool poll(int64_t id) { return eng_->poll(id); }

  py::object wait(int64_t id, std::optional<double> timeout_s) {
    const double t = timeout_s.value_or(std::numeric_limits<double>::infinity());
    Result r;
    bool ok;
    {
      py::gil_scoped_release nogil;
      ok = eng_->wait(id, t, &r);
    }
    if (!ok) return py::none();
    exports_.erase(id);
    return py::make_tuple(r.bytes, r.err, r.err_offset, r.err_length);
  }

  Engine& engine() { return *eng_; }

 private:
  std::unique_ptr<Engine> eng_;
  std::unordered_map<int64_t, std::unique_ptr<Export>> exports_;
};

}  // namespace

void register_aio(py::module_& m) {
  py::class_<File, std::shared_ptr<File>>(
      m, "AioFile",
      "A file for AioEngine: owns fd and tail_fd (-1: none) from now on. Internal: use offload.aio.AioEngine.open.")
      .def(py::init<int, int>(), py::arg("fd"), py::arg("tail_fd") = -1)
      .def("close", &File::close,
           "No new transfers; the descriptors close once no queued transfer uses them (idempotent).")
      .def_property_readonly("closed", &File::closed)
      .def_property_readonly("fd", &File::fd, "The main descriptor, or -1 once closed.")
      .def_property_readonly("tail_fd", &File::tail_fd, "The buffered tail descriptor, or -1 (none or closed).")
      .def_property_readonly("direct", &File::direct);

  py::class_<PyEngine>(m, "AioEngine", "Worker-pool async file I/O engine. Internal: use offload.aio.AioEngine.")
      .def(py::init<int, int64_t>(), py::arg("queue_depth"), py::arg("block_size"))
      .def("submit", &PyEngine::submit, py::arg("op"), py::arg("file"), py::arg("buffer"),
           py::arg("length") = py::none(), py::arg("offset") = 0,
           "Queue a read (op=0) or write (op=1) of length (default: all) bytes between the start of buffer "
           "and file@offset; returns an id. The buffer export is held until wait() returns for the id.")
      .def("poll", &PyEngine::poll, py::arg("id"), "True once the request has finished.")
      .def("wait", &PyEngine::wait, py::arg("id"), py::arg("timeout_s") = py::none(),
           "Wait for a request (timeout_s None or inf: forever): (bytes, err, err_offset, err_length), or None "
           "on timeout. err: 0 ok, >0 errno, -1 end of file.")
      .def("outstanding", [](PyEngine& e) { return e.engine().outstanding(); })
      .def(
          "_set_fault", [](PyEngine& e, int kind, int64_t nth) { e.engine().set_fault(kind, nth); },
          py::arg("kind"), py::arg("nth"),
          "Test hook: make the nth system call from now fail (1 EIO, 2 short transfer, 3 EINTR).")
      .def("stats",
           [](PyEngine& e) {
             const Stats s = e.engine().stats();
             py::dict d;
             d["bytes_read"] = s.bytes_read;
             d["bytes_written"] = s.bytes_written;
             d["requests"] = s.requests;
             d["pieces"] = s.pieces;
             d["syscalls"] = s.syscalls;
             d["short_resumed"] = s.short_resumed;
             d["eintr_resumed"] = s.eintr_resumed;
             d["errors"] = s.errors;
             return d;
           })
      .def_property_readonly("owner_pid", [](PyEngine& e) { return static_cast<int64_t>(e.engine().owner_pid()); })
      .def_property_readonly("queue_depth", [](PyEngine& e) { return e.engine().queue_depth(); })
      .def_property_readonly("block_size", [](PyEngine& e) { return e.engine().block_size(); });
  m.attr("AIO_DIRECT_ALIGN") = offload::aio::kDirectAlign;
}
