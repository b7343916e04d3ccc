// aio.cpp: worker-pool implementation of the async file I/O engine declared in aio.h.
#include "aio.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
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

// ------------------------------------------------------------------------------------ File
File::File(int fd, int tail_fd) : fd_(fd), tail_fd_(tail_fd) {
  fl_ = fd_flags(fd, "fd");
  direct_ = (fl_ & O_DIRECT) != 0;
  if (tail_fd >= 0) {
    if (tail_fd == fd) throw std::invalid_argument("tail_fd must differ from fd");
    tail_fl_ = fd_flags(tail_fd, "tail_fd");
    if (tail_fl_ & O_DIRECT) throw std::invalid_argument("tail_fd must be opened without O_DIRECT");
  } else if (tail_fd != -1) {
    throw std::invalid_argument("tail_fd must be an open descriptor or -1");
  }
}

File::~File() {
  // Every request holds the File alive, so no transfer is in flight here.
  if (!closed_.exchange(true)) release();
}

void File::close() {
  if (!closed_.exchange(true)) release();
}

bool File::acquire() {
  if (closed_.load()) return false;
  int64_t r = refs_.load();
  do {
    if (r == 0) return false;  // descriptors already closed
  } while (!refs_.compare_exchange_weak(r, r + 1));
  return true;
}

void File::release() {
  if (refs_.fetch_sub(1) == 1) {
    ::close(fd_);
    if (tail_fd_ >= 0) ::close(tail_fd_);
  }
}

// ---------------------------------------------------------------------------------- Engine
struct Engine::Core {
  struct Request {
    int op = 0;
    int64_t remaining = 0;  // pieces not yet finished
    Result res;
    bool done = false;
    std::shared_ptr<File> file;  // holds one File::acquire() until the request is done
  };
  struct Piece {
    std::shared_ptr<Request> req;
    int op, fd;
    bool direct;
    char* buf;
    int64_t len, off;
  };

  explicit Core(int64_t bs) : block_size(bs) {}
  void worker();
  void run_piece(Piece& p);
  // One system call with fault injection; returns bytes or -errno.
  int64_t sys_io(int op, int fd, char* buf, int64_t len, int64_t off, bool direct);

  const int64_t block_size;
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  std::deque<Piece> queue;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests;
  int64_t next_id = 1;
  bool stop = false;
  std::vector<std::thread> workers;
  Stats stats;
  std::atomic<int> fault_kind{kFaultNone};
  std::atomic<int64_t> fault_countdown{0};
};

Engine::Engine(int queue_depth, int64_t block_size)
    : owner_(getpid()), queue_depth_(queue_depth), block_size_(block_size), core_(nullptr) {
  if (queue_depth < 1 || queue_depth > 256) throw std::invalid_argument("queue_depth must be in [1, 256]");
  if (block_size <= 0 || !is_aligned(block_size) || block_size > (int64_t(1) << 30))
    throw std::invalid_argument("block_size must be a positive multiple of 4096 bytes, at most 1 GiB");
  core_ = new Core(block_size);
  Core* c = core_;
  try {
    c->workers.reserve(queue_depth);
    for (int i = 0; i < queue_depth; ++i) c->workers.emplace_back([c] { c->worker(); });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lk(c->mu);
      c->stop = true;
    }
    c->work_cv.notify_all();
    for (auto& t : c->workers) t.join();
    delete c;
    throw;
  }
}

Engine::~Engine() {
  if (getpid() != owner_) return;  // forked child: the workers (and maybe a held mutex) are the parent's
  {
    std::lock_guard<std::mutex> lk(core_->mu);
    core_->stop = true;
  }
  core_->work_cv.notify_all();
  for (auto& t : core_->workers) t.join();
  delete core_;
}

void Engine::check_process() const {
  const pid_t me = getpid();
  if (me != owner_)
    throw std::runtime_error("this AioEngine was created in process " + std::to_string(owner_) +
                             "; it cannot be used after fork (this is process " + std::to_string(me) +
                             "): create the optimizer in the child");
}

int64_t Engine::submit(int op, const std::shared_ptr<File>& file, void* buf, int64_t len, int64_t off) {
  check_process();
  if (op != kRead && op != kWrite) throw std::invalid_argument("op must be 0 (read) or 1 (write)");
  if (!file) throw std::invalid_argument("no file");
  if (len < 0) throw std::invalid_argument("negative length");
  if (off < 0) throw std::invalid_argument("negative file offset");
  if (len > 0 && buf == nullptr) throw std::invalid_argument("null buffer");
  if (len > INT64_MAX - off) throw std::invalid_argument("offset + length overflows");
  if (file->closed()) throw std::invalid_argument("the file is closed");
  check_access(file->fl_, op, "the file");
  const bool direct = file->direct_;
  char* const base = static_cast<char*>(buf);
  int64_t body = len;  // bytes that go through fd; the rest through tail_fd
  if (direct && len > 0) {
    if (!is_aligned(static_cast<int64_t>(reinterpret_cast<uintptr_t>(buf))) || !is_aligned(off))
      throw std::invalid_argument("O_DIRECT transfer needs a 4096-byte aligned buffer address and file offset");
    body = len / kDirectAlign * kDirectAlign;
    if (body != len) {
      if (file->tail_fd_ < 0)
        throw std::invalid_argument("O_DIRECT transfer length is not a multiple of 4096 and the file has no "
                                    "buffered tail_fd");
      check_access(file->tail_fl_, op, "the file's tail_fd");
    }
  }
  if (!file->acquire()) throw std::invalid_argument("the file is closed");
  auto req = std::make_shared<Core::Request>();
  req->op = op;
  req->file = file;
  std::vector<Core::Piece> pieces;
  int64_t id;
  try {
    const int64_t bs = block_size_;
    pieces.reserve(static_cast<size_t>(body / bs + 2));
    for (int64_t b = 0; b < body; b += bs)
      pieces.push_back(Core::Piece{req, op, file->fd_, direct, base + b, std::min(bs, body - b), off + b});
    if (body != len) pieces.push_back(Core::Piece{req, op, file->tail_fd_, false, base + body, len - body, off + body});
    req->remaining = static_cast<int64_t>(pieces.size());
    std::lock_guard<std::mutex> lk(core_->mu);
    if (core_->stop) throw std::invalid_argument("engine is shut down");
    id = core_->next_id++;
    core_->requests.emplace(id, req);
    core_->stats.requests += 1;
    if (pieces.empty()) req->done = true;
    else for (auto& p : pieces) core_->queue.push_back(std::move(p));
  } catch (...) {
    file->release();
    throw;
  }
  if (pieces.empty()) file->release();
  else if (pieces.size() == 1) core_->work_cv.notify_one();
  else core_->work_cv.notify_all();
  return id;
}

void Engine::Core::worker() {
  for (;;) {
    Piece p;
    {
      std::unique_lock<std::mutex> lk(mu);
      work_cv.wait(lk, [this] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stop and drained
      p = std::move(queue.front());
      queue.pop_front();
    }
    run_piece(p);
  }
}

int64_t Engine::Core::sys_io(int op, int fd, char* buf, int64_t len, int64_t off, bool direct) {
  int kind = fault_kind.load(std::memory_order_relaxed);
  if (kind != kFaultNone && fault_countdown.fetch_sub(1) == 1) {
    fault_kind.store(kFaultNone);
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

void Engine::Core::run_piece(Piece& p) {
  Request& req = *p.req;
  bool skip;
  {
    std::lock_guard<std::mutex> lk(mu);
    skip = req.res.err != 0;  // request already failed: do not touch the file further
  }
  int64_t done = 0, calls = 0, shorts = 0, eintrs = 0;
  int err = 0;
  if (!skip) {
    while (done < p.len) {
      const int64_t r = sys_io(p.op, p.fd, p.buf + done, p.len - done, p.off + done, p.direct);
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
    std::lock_guard<std::mutex> lk(mu);
    stats.pieces += 1;
    stats.syscalls += calls;
    stats.short_resumed += shorts;
    stats.eintr_resumed += eintrs;
    (p.op == kRead ? stats.bytes_read : stats.bytes_written) += done;
    req.res.bytes += done;
    if (err != 0 && req.res.err == 0) {
      req.res.err = err;
      req.res.err_offset = p.off;
      req.res.err_length = p.len;
      stats.errors += 1;
    }
    finished = --req.remaining == 0;
  }
  if (finished) {
    // The descriptors are released before the request is marked done: once a waiter sees it
    // finished (and, say, closes the file and opens another), no piece can touch them again.
    req.file->release();
    {
      std::lock_guard<std::mutex> lk(mu);
      req.done = true;
    }
    done_cv.notify_all();
  }
}

bool Engine::poll(int64_t id) {
  check_process();
  std::lock_guard<std::mutex> lk(core_->mu);
  auto it = core_->requests.find(id);
  if (it == core_->requests.end()) throw std::invalid_argument("unknown request id " + std::to_string(id));
  return it->second->done;
}

bool Engine::wait(int64_t id, double timeout_s, Result* out) {
  check_process();
  if (std::isnan(timeout_s) || timeout_s < 0)
    throw std::invalid_argument("timeout must be a non-negative number of seconds (or None/inf: wait forever), got " +
                                std::to_string(timeout_s));
  std::unique_lock<std::mutex> lk(core_->mu);
  auto it = core_->requests.find(id);
  if (it == core_->requests.end()) throw std::invalid_argument("unknown request id " + std::to_string(id));
  std::shared_ptr<Core::Request> req = it->second;
  constexpr double kForever = 1e9;  // ~31 years: longer is the same as forever (and cannot overflow the clock)
  if (timeout_s >= kForever) {
    core_->done_cv.wait(lk, [&] { return req->done; });
  } else {
    const auto dl = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(timeout_s));
    if (!core_->done_cv.wait_until(lk, dl, [&] { return req->done; })) return false;
  }
  *out = req->res;
  core_->requests.erase(id);
  return true;
}

int64_t Engine::outstanding() {
  check_process();
  std::lock_guard<std::mutex> lk(core_->mu);
  return static_cast<int64_t>(core_->requests.size());
}

void Engine::set_fault(int kind, int64_t nth) {
  if (kind < kFaultNone || kind > kFaultEINTR) throw std::invalid_argument("unknown fault kind");
  if (kind != kFaultNone && nth < 1) throw std::invalid_argument("fault position must be >= 1");
  core_->fault_kind.store(kFaultNone);
  core_->fault_countdown.store(nth);
  core_->fault_kind.store(kind);
}

Stats Engine::stats() {
  check_process();
  std::lock_guard<std::mutex> lk(core_->mu);
  return core_->stats;
}

}  // namespace aio
}  // namespace offload
