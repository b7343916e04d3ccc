// aio.h: the native asynchronous file I/O engine used for NVMe-resident optimizer state.
// A pool of worker threads runs pread/pwrite between file descriptors and caller-owned host
// buffers. A request (one contiguous file range) is cut into block_size pieces; up to
// queue_depth pieces are in flight at once (one per worker thread). Short transfers and EINTR
// are resumed; any other failure is recorded with errno, offset and length and reported when
// the caller waits. io_uring is not used (see docs/nvme.md): the build needs no liburing.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace offload {
namespace aio {

enum Op : int { kRead = 0, kWrite = 1 };

// Alignment O_DIRECT transfers must respect here (offset, length and buffer address).
constexpr int64_t kDirectAlign = 4096;

// Test-only fault injection: the n-th system call from now misbehaves once.
enum Fault : int { kFaultNone = 0, kFaultEIO = 1, kFaultShort = 2, kFaultEINTR = 3 };

// Outcome of a finished request. err == 0: success, bytes == length. err > 0: errno of the
// first failing piece, which covered [err_offset, err_offset + err_length). err == kErrEOF:
// a read hit end of file before the request was complete.
struct Result {
  int64_t bytes = 0;
  int err = 0;
  int64_t err_offset = 0;
  int64_t err_length = 0;
};
constexpr int kErrEOF = -1;

struct Stats {
  int64_t bytes_read = 0, bytes_written = 0;
  int64_t requests = 0, pieces = 0, syscalls = 0;
  int64_t short_resumed = 0, eintr_resumed = 0, errors = 0;
};

class Engine {
 public:
  // queue_depth: worker threads = pieces in flight (1..256); block_size: piece size in bytes,
  // a positive multiple of kDirectAlign.
  Engine(int queue_depth, int64_t block_size);
  ~Engine();  // finishes every queued piece, then joins the workers
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queue a transfer of len bytes between buf and fd at offset off; returns a request id.
  // If fd was opened with O_DIRECT, buf and off must be kDirectAlign-aligned; a length that is
  // not a multiple of kDirectAlign needs tail_fd (same file, buffered) for the last piece.
  // Throws std::invalid_argument on bad arguments (nothing is queued then).
  int64_t submit(int op, int fd, int tail_fd, void* buf, int64_t len, int64_t off);
  // True once the request has finished (successfully or not). Unknown id: invalid_argument.
  bool poll(int64_t id);
  // Block until the request finishes or timeout_s passes (< 0: forever). Returns false on
  // timeout; otherwise fills *out and forgets the request.
  bool wait(int64_t id, double timeout_s, Result* out);
  // Requests submitted and not yet waited for.
  int64_t outstanding();
  void set_fault(int kind, int64_t nth);
  Stats stats();
  int queue_depth() const { return static_cast<int>(workers_.size()); }
  int64_t block_size() const { return block_size_; }

 private:
  struct Request {
    int op = 0;
    int64_t remaining = 0;  // pieces not yet finished
    Result res;
    bool done = false;
  };
  struct Piece {
    std::shared_ptr<Request> req;
    int op, fd;
    char* buf;
    int64_t len, off;
  };
  void worker();
  void run_piece(Piece& p);
  // One system call with fault injection; returns bytes or -errno.
  int64_t sys_io(int op, int fd, char* buf, int64_t len, int64_t off, bool direct);

  const int64_t block_size_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Piece> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  int64_t next_id_ = 1;
  bool stop_ = false;
  std::vector<std::thread> workers_;
  Stats stats_;
  std::atomic<int> fault_kind_{kFaultNone};
  std::atomic<int64_t> fault_countdown_{0};
};

}  // namespace aio
}  // namespace offload
