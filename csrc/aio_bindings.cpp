// aio_bindings.cpp: Python binding of the async I/O engine (offload._C.AioEngine), registered
// into offload._C by register_aio(). Raw addresses and descriptors in, plain tuples out; the
// validated, tensor-level API is offload/aio.py. The GIL is released while waiting.
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "aio.h"

namespace py = pybind11;
using offload::aio::Engine;
using offload::aio::Result;
using offload::aio::Stats;

void register_aio(py::module_& m) {
  py::class_<Engine>(m, "AioEngine",
                     "Worker-pool async file I/O engine. Internal: use offload.aio.AioEngine.")
      .def(py::init<int, int64_t>(), py::arg("queue_depth"), py::arg("block_size"))
      .def(
          "submit",
          [](Engine& e, int op, int fd, int tail_fd, uintptr_t buf, int64_t len, int64_t off) {
            return e.submit(op, fd, tail_fd, reinterpret_cast<void*>(buf), len, off);
          },
          py::arg("op"), py::arg("fd"), py::arg("tail_fd"), py::arg("buf"), py::arg("length"),
          py::arg("offset"),
          "Queue a read (op=0) or write (op=1) of length bytes at buf <-> fd@offset; returns an id.")
      .def("poll", &Engine::poll, py::arg("id"), "True once the request has finished.")
      .def(
          "wait",
          [](Engine& e, int64_t id, double timeout_s) -> py::object {
            Result r;
            bool ok;
            {
              py::gil_scoped_release nogil;
              ok = e.wait(id, timeout_s, &r);
            }
            if (!ok) return py::none();
            return py::make_tuple(r.bytes, r.err, r.err_offset, r.err_length);
          },
          py::arg("id"), py::arg("timeout_s") = -1.0,
          "Wait for a request: (bytes, err, err_offset, err_length), or None on timeout. "
          "err: 0 ok, >0 errno, -1 end of file.")
      .def("outstanding", &Engine::outstanding)
      .def("_set_fault", &Engine::set_fault, py::arg("kind"), py::arg("nth"),
           "Test hook: make the nth system call from now fail (1 EIO, 2 short transfer, 3 EINTR).")
      .def("stats",
           [](Engine& e) {
             const Stats s = e.stats();
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
      .def_property_readonly("queue_depth", &Engine::queue_depth)
      .def_property_readonly("block_size", &Engine::block_size);
  m.attr("AIO_DIRECT_ALIGN") = offload::aio::kDirectAlign;
}
