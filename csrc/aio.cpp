// aio.cpp: worker-pool implementation of the async file I/O engine declared in aio.h.
#include "aio.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <stdexcept>
#include <string>

namespace offload {
namespace aio {

namespace {

bool is_aligned(int64_t x) { return (x & (kDirectAlign - 1)) == 0; }

// Access mode and O_DIRECT flag of an open descriptor; throws on a bad fd.
int fd_flags(int fd, const char* what) {
  if (fd < 0) throw std::invalid_argument(std::string(what) + ": negative file descriptor");
  const int fl = fcntl(fd, F_GETFL);
  if (fl == -1) throw std::invalid_argument(std::string(what) + ": not an open file descriptor (" +
                                            std::to_string(fd) + ")");
  return fl;
}

void check_access(int fl, int op, const char* what) {
  const int acc = fl & O_ACCMODE;
  if (op == kRead && acc == O_WRONLY)
    throw std::invalid_argument(std::string(what) + " is write-only: cannot read from it");
  if (op == kWrite && acc == O_RDONLY)
    throw std::invalid_argument(std::string(what) + " is read-only: cannot write to it");
}

}  // namespace

Engine::Engine(int queue_depth, int64_t block_size) : block_size_(block_size) {
  if (queue_depth < 1 || queue_depth > 256) throw std::invalid_argument("queue_depth must be in [1, 256]");
  if (block_size <= 0 || !is_aligned(block_size) || block_size > (int64_t(1) << 30))
    throw std::invalid_argument("block_size must be a positive multiple of 4096 bytes, at most 1 GiB");
  workers_.reserve(queue_depth);
  for (int i = 0; i < queue_depth; ++i) workers_.emplace_back([this] { worker(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

int64_t Engine::submit(int op, int fd, int tail_fd, void* buf, int64_t len, int64_t off) {
  if (op != kRead && op != kWrite) throw std::invalid_argument("op must be 0 (read) or 1 (write)");
  if (len < 0) throw std::invalid_argument("negative length");
  if (off < 0) throw std::invalid_argument("negative file offset");
  if (len > 0 && buf == nullptr) throw std::invalid_argument("null buffer");
  if (len > INT64_MAX - off) throw std::invalid_argument("offset + length overflows");
  const int fl = fd_flags(fd, "fd");
  check_access(fl, op, "fd");
  const bool direct = (fl & O_DIRECT) != 0;
  char* const base = static_cast<char*>(buf);
  int64_t body = len;  // bytes that go through fd; the rest through tail_fd
  if (direct) {
    if (!is_aligned(reinterpret_cast<uintptr_t>(buf)) || !is_aligned(off))
      throw std::invalid_argument("O_DIRECT transfer needs a 4096-byte aligned buffer address and file offset");
    body = len / kDirectAlign * kDirectAlign;
    if (body != len) {
      if (tail_fd < 0)
        throw std::invalid_argument("O_DIRECT transfer length is not a multiple of 4096 and no buffered "
                                    "tail_fd was given");
      const int tfl = fd_flags(tail_fd, "tail_fd");
      check_access(tfl, op, "tail_fd");
      if (tfl & O_DIRECT) throw std::invalid_argument("tail_fd must be opened without O_DIRECT");
    }
  }
  auto req = std::make_shared<Request>();
  req->op = op;
  std::vector<Piece> pieces;
  for (int64_t b = 0; b < body; b += block_size_)
    pieces.push_back(Piece{req, op, fd, base + b, std::min(block_size_, body - b), off + b});
  if (body != len) pieces.push_back(Piece{req, op, tail_fd, base + body, len - body, off + body});
  req->remaining = static_cast<int64_t>(pieces.size());
  int64_t id;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) throw std::invalid_argument("engine is shut down");
    id = next_id_++;
    requests_.emplace(id, req);
    stats_.requests += 1;
    if (pieces.empty()) {
      req->done = true;
    } else {
      for (auto& p : pieces) queue_.push_back(std::move(p));
    }
  }
  if (pieces.size() == 1) work_cv_.notify_one();
  else if (!pieces.empty()) work_cv_.notify_all();
  return id;
}

void Engine::worker() {
  for (;;) {
    Piece p;
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      p = std::move(queue_.front());
      queue_.pop_front();
    }
    run_piece(p);
  }
}

int64_t Engine::sys_io(int op, int fd, char* buf, int64_t len, int64_t off, bool direct) {
  int kind = fault_kind_.load(std::memory_order_relaxed);
  if (kind != kFaultNone && fault_countdown_.fetch_sub(1) == 1) {
    fault_kind_.store(kFaultNone);
    if (kind == kFaultEIO) return -EIO;
    if (kind == kFaultEINTR) return -EINTR;
    if (kind == kFaultShort) {  // transfer part of the piece only (keeping O_DIRECT alignment)
      int64_t part = direct ? (len / 2) / kDirectAlign * kDirectAlign : len / 2;
      if (part > 0) len = part;
    }
  }
  const ssize_t r = op == kRead ? ::pread(fd, buf, static_cast<size_t>(len), off)
                                : ::pwrite(fd, buf, static_cast<size_t>(len), off);
  return r < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(r);
}

void Engine::run_piece(Piece& p) {
  Request& req = *p.req;
  bool skip;
  {
    std::lock_guard<std::mutex> lk(mu_);
    skip = req.res.err != 0;  // request already failed: do not touch the file further
  }
  int64_t done = 0, calls = 0, shorts = 0, eintrs = 0;
  int err = 0;
  if (!skip) {
    const int fl = fcntl(p.fd, F_GETFL);
    const bool direct = fl != -1 && (fl & O_DIRECT);
    while (done < p.len) {
      const int64_t r = sys_io(p.op, p.fd, p.buf + done, p.len - done, p.off + done, direct);
      ++calls;
      if (r == -EINTR || r == -EAGAIN) { ++eintrs; continue; }
      if (r < 0) { err = static_cast<int>(-r); break; }
      if (r == 0) {  // read at end of file (a write of 0 bytes would loop forever: treat alike)
        err = p.op == kRead ? kErrEOF : EIO;
        break;
      }
      done += r;
      if (done < p.len) ++shorts;
    }
  }
  bool finished;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.pieces += 1;
    stats_.syscalls += calls;
    stats_.short_resumed += shorts;
    stats_.eintr_resumed += eintrs;
    (p.op == kRead ? stats_.bytes_read : stats_.bytes_written) += done;
    req.res.bytes += done;
    if (err != 0 && req.res.err == 0) {
      req.res.err = err;
      req.res.err_offset = p.off;
      req.res.err_length = p.len;
      stats_.errors += 1;
    }
    finished = --req.remaining == 0;
    if (finished) req.done = true;
  }
  if (finished) done_cv_.notify_all();
}

bool Engine::poll(int64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) throw std::invalid_argument("unknown request id " + std::to_string(id));
  return it->second->done;
}

bool Engine::wait(int64_t id, double timeout_s, Result* out) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) throw std::invalid_argument("unknown request id " + std::to_string(id));
  std::shared_ptr<Request> req = it->second;
  if (timeout_s < 0) {
    done_cv_.wait(lk, [&] { return req->done; });
  } else {
    const auto dl = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(timeout_s));
    if (!done_cv_.wait_until(lk, dl, [&] { return req->done; })) return false;
  }
  *out = req->res;
  requests_.erase(id);
  return true;
}

int64_t Engine::outstanding() {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(requests_.size());
}

void Engine::set_fault(int kind, int64_t nth) {
  if (kind < kFaultNone || kind > kFaultEINTR) throw std::invalid_argument("unknown fault kind");
  if (kind != kFaultNone && nth < 1) throw std::invalid_argument("fault position must be >= 1");
  fault_kind_.store(kFaultNone);
  fault_countdown_.store(nth);
  fault_kind_.store(kind);
}

Stats Engine::stats() {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

}  // namespace aio
}  // namespace offload
