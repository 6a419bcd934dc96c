// NCCL data plane. The communicator is created non-blocking
// (ncclCommInitRankConfig with blocking = 0) so that creation and every
// collective are bounded by deadlines, and a 1-byte warm-up broadcast inside
// creation sets up NCCL's lazily connected channels under init_timeout.
//
// Streams: each communicator owns one non-blocking CUDA stream. order_after
// makes it wait (cudaStreamWaitEvent) for a caller's stream or the copy
// stream. A Work completes when a host function queued after its broadcast
// (cudaLaunchHostFunc) runs; the waiting thread sleeps on a condition and
// wakes every millisecond only to look for an asynchronous error or abort.
//
// Point to point: ncclSend/ncclRecv. NCCL matches a pair's moves by issue
// order (tags are the caller's bookkeeping). Moves issued between
// begin_moves() and end_moves() are one NCCL group (ncclGroupStart/End) and
// one launch: every Work of the group completes with it. A move issued
// outside a group is a group of one. Zero bytes complete at once on both
// ends (both know the size) without reaching NCCL.
//
// Slowness: NCCL shows no per-link progress, so a completed launch (a
// broadcast, a group) is the progress a waiter sees; a Work fails with
// kTimeout when no launch of the communicator completed for stall_timeout
// (since it was issued, or since the previous one completed). op_timeout
// backs the enqueue only.
//
// Failure: any error or deadline leads to abort(), which marks the
// communicator failed at once and hands ncclCommAbort to an AbortReaper
// thread: it never blocks the caller (a control thread). An abort while the
// issuing thread has a group open is handed over at its end_moves(), which
// must first close the thread's NCCL group on a live communicator. A Work of an
// aborted communicator waits (bounded) for that teardown, so its buffer is
// not reused under a running kernel. ncclCommFinalize is only called on an
// idle, healthy communicator at destruction.
//
// Thread-safety: broadcast/order_after from one thread at a time; abort and
// async_error from any thread. NCCL's group state is the thread's, not the
// communicator's: while the issuing thread has a group open it makes no
// other NCCL call (another communicator's included), or that call would
// join the group. comm_mu_ guards every call on comm_, and
// gone_ (set under it) ends them before the reaper frees the communicator.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/data/device_memory.h"
#include "common/data/nccl/abort_reaper.h"
#include "common/data/nccl/device_guard.h"
#include "common/data/nccl/nccl_check.h"
#include "common/data/nccl/nccl_factory.h"
#include "common/log.h"
#include "common/units.h"

namespace paramcast::nccl_backend {
namespace {

constexpr auto kErrorPoll = std::chrono::milliseconds(1);
// How long a Work of an aborted communicator waits for ncclCommAbort.
constexpr auto kAbortGrace = std::chrono::seconds(10);

// Polls until the communicator leaves ncclInProgress or the deadline passes.
Status poll_comm(ncclComm_t comm, Deadline deadline, const std::atomic<bool>* aborted, const char* what) {
  for (;;) {
    ncclResult_t async = ncclSuccess;
    PC_NCCL_RETURN(ncclCommGetAsyncError(comm, &async));
    if (async == ncclSuccess) return Status();
    if (async != ncclInProgress) return nccl_status(async, what, comm);
    if (aborted && aborted->load()) return paramcast::aborted(std::string(what) + ": communicator aborted");
    if (Clock::now() >= deadline) return timeout_error(std::string(what) + " did not finish before its deadline");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// Set by a host function queued on the stream after a launch.
struct Completion {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  static void CUDART_CB fire(void* arg) {
    auto* self = static_cast<std::shared_ptr<Completion>*>(arg);
    {
      std::lock_guard<std::mutex> lock((*self)->mu);
      (*self)->done = true;
    }
    (*self)->cv.notify_all();
    delete self;
  }
  bool wait_until(Deadline until) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_until(lock, until, [&] { return done; });
  }
  bool is_done() {
    std::lock_guard<std::mutex> lock(mu);
    return done;
  }
};

// One launch: a broadcast, or a group of point-to-point moves; its Works
// share it. Touched by the issuing thread only.
struct Launch {
  explicit Launch(const char* w) : what(w) {}
  const char* what;                  // for messages: "ncclBroadcast", ...
  std::shared_ptr<Completion> done;  // null: nothing reached the stream
  Status status;
  // Work reached NCCL before the failure: its kernels may still write the
  // buffers until the abort that followed ends.
  bool queued = false;
  bool open = false;  // a group whose end_moves() has not come yet
  // A group of moves is not held to stall_timeout: under a round-by-round
  // plan a rank's group rightly waits while its peers finish earlier rounds
  // with others. Its bound is the caller's deadline.
  bool stall_checked = true;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(const GroupOptions& options, ncclComm_t comm, cudaStream_t stream, cudaEvent_t ordered)
      : options_(options), comm_(comm), stream_(stream), ordered_(ordered) {}
  ~NcclCommunicator() override;

  std::shared_ptr<Work> broadcast(void* data, size_t bytes, int root) override;
  std::shared_ptr<Work> send(const void* data, size_t bytes, int peer, uint32_t tag) override;
  std::shared_ptr<Work> recv(void* data, size_t bytes, int peer, uint32_t tag) override;
  void begin_moves() override;
  Status end_moves() override;
  Status order_after(void* stream) override;
  void abort(const std::string& reason) override;
  Status async_error() override;

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  Device device() const override { return options_.device; }

 private:
  struct Event;
  Status unusable() {
    std::lock_guard<std::mutex> lock(err_mu_);
    return aborted("communicator of epoch " + std::to_string(options_.epoch) + " is unusable: " +
                   (error_.ok() ? std::string("aborted") : error_.to_string()));
  }
  void fail(const Status& s) {
    std::lock_guard<std::mutex> lock(err_mu_);
    if (error_.ok()) error_ = s;
  }
  std::string where() const {
    return "epoch " + std::to_string(options_.epoch) + ", rank " + std::to_string(options_.rank);
  }
  std::shared_ptr<Work> move(bool send, void* data, size_t bytes, int peer);
  void hand_to_reaper();  // comm_mu_ held

  const GroupOptions options_;
  const ncclComm_t comm_;
  const cudaStream_t stream_;
  const cudaEvent_t ordered_;
  std::mutex comm_mu_;
  bool gone_ = false;  // comm_ handed to the reaper (guarded by comm_mu_)
  // The issuing thread is inside ncclGroupStart/End on comm_, and an abort
  // that came meanwhile waits for end_moves() (both guarded by comm_mu_).
  bool in_group_ = false;
  std::atomic<bool> abort_deferred_{false};
  // ncclCommAbort outlived kAbortGrace once: later Works do not wait again.
  std::atomic<bool> abort_overdue_{false};
  std::shared_ptr<Launch> group_;  // the open group's launch (issuing thread)
  std::atomic<bool> aborted_{false};
  std::mutex err_mu_;
  Status error_;
  std::shared_ptr<Completion> last_;  // the latest launch's (issuing thread)
  // When a waiter last saw a launch complete (steady-clock ns): NCCL shows
  // no per-link progress, so a completion is the progress it has.
  std::atomic<int64_t> progress_ns_{0};
  AbortReaper reaper_;
};

struct NcclCommunicator::Event : Work {
  Event(NcclCommunicator* c, std::shared_ptr<Launch> l) : comm(c), launch(std::move(l)) {}
  Status wait(Deadline deadline) override;
  bool settled() override {
    if (!launch->status.ok()) return !launch->queued || comm->reaper_.finished();
    return !launch->done || launch->done->is_done() || comm->reaper_.finished();
  }
  NcclCommunicator* comm;
  std::shared_ptr<Launch> launch;
  Clock::time_point issued = Clock::now();
  // After an abort: the launch's kernels may still write its buffers until
  // the abort ends, so wait for it (bounded) before the caller reuses them.
  void await_abort() const {
    // An abort deferred by this thread's own open group cannot start before
    // its end_moves(); one that overran its grace once is not waited again.
    // Either way settled() stays false: the buffers are let go, not reused.
    if (comm->abort_deferred_.load() || comm->abort_overdue_.load()) return;
    if (!comm->reaper_.wait_for(kAbortGrace)) {
      comm->abort_overdue_.store(true);
      PC_WARN("nccl (" << comm->where() << "): ncclCommAbort still running after "
                       << std::chrono::seconds(kAbortGrace).count() << "s; the " << launch->what
                       << "'s buffers are let go");
    }
  }
};

Status NcclCommunicator::Event::wait(Deadline deadline) {
  if (launch->open)
    return internal_error(std::string("a move of an open ") + launch->what +
                               " waited on before end_moves() (" + comm->where() + ")");
  if (!launch->status.ok() && launch->queued) await_abort();
  if (!launch->status.ok() || !launch->done) return launch->status;
  const std::shared_ptr<Completion>& done = launch->done;
  for (;;) {
    if (done->wait_until(std::min(deadline, Clock::now() + kErrorPoll))) {
      comm->progress_ns_ = Clock::now().time_since_epoch().count();
      return Status();
    }
    // No launch of this communicator completed since this one was issued
    // or the previous one completed, whichever is later.
    const auto since = std::max(issued, Clock::time_point(Clock::duration(comm->progress_ns_.load())));
    const auto still = Clock::now() - since;
    Status failure;
    if (comm->aborted_.load()) {
      failure = comm->unusable();
    } else if (Status async = comm->async_error(); !async.ok()) {
      comm->abort(async.message());
      failure = async;
    } else if (launch->stall_checked && still > comm->options_.stall_timeout) {
      comm->abort("no progress for stall_timeout");
      failure = timeout_error(std::string(launch->what) + " made no progress for " + format_duration(still) +
                              " (stall_timeout " + format_duration(comm->options_.stall_timeout) +
                              "; NCCL shows no per-link progress: nothing completed) (" + comm->where() +
                              "); ncclCommAbort called");
    } else if (Clock::now() >= deadline) {
      comm->abort(std::string(launch->what) + " deadline passed");
      failure = timeout_error(std::string(launch->what) + " did not finish before its deadline (" + comm->where() +
                              "); ncclCommAbort called");
    } else {
      continue;
    }
    if (!done->is_done()) await_abort();
    return failure;
  }
}

NcclCommunicator::~NcclCommunicator() {
  if (group_) (void)end_moves();  // a caller's open group: closed before anything else
  DeviceGuard g(options_.device.index);
  bool finalize = false;
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (!gone_) {
      ncclResult_t async = ncclSuccess;
      finalize = (!last_ || last_->is_done()) && ncclCommGetAsyncError(comm_, &async) == ncclSuccess &&
                 async == ncclSuccess;
      if (finalize) gone_ = true;
    }
  }
  if (finalize) {
    // Idle and healthy: flush and destroy, bounded; abort if that stalls.
    const ncclResult_t r = ncclCommFinalize(comm_);
    if ((r == ncclSuccess || r == ncclInProgress) &&
        poll_comm(comm_, Clock::now() + std::chrono::seconds(5), nullptr, "ncclCommFinalize").ok()) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);
    }
    cudaEventDestroy(ordered_);
    cudaStreamDestroy(stream_);
    return;
  }
  abort("communicator destroyed");  // work in progress or failed: never Finalize
}

std::shared_ptr<Work> NcclCommunicator::broadcast(void* data, size_t bytes, int root) {
  auto launch = std::make_shared<Launch>("ncclBroadcast");
  auto work = std::make_shared<Event>(this, launch);
  if (bytes == 0) return work;
  if (group_) {
    launch->status = internal_error("ncclBroadcast inside begin_moves()/end_moves() (" + where() + ")");
    return work;
  }
  Status s;
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (gone_ || aborted_.load()) {
      launch->status = unusable();
      return work;
    }
    DeviceGuard g(options_.device.index);
    auto done = std::make_shared<Completion>();
    s = nccl_status(ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, stream_), "ncclBroadcast", comm_);
    launch->queued = s.ok();
    if (s.ok()) s = poll_comm(comm_, Clock::now() + options_.op_timeout, &aborted_, "ncclBroadcast enqueue");
    if (s.ok()) {
      auto* arg = new std::shared_ptr<Completion>(done);
      s = cuda_status(cudaLaunchHostFunc(stream_, &Completion::fire, arg), "cudaLaunchHostFunc");
      if (!s.ok()) delete arg;
    }
    if (s.ok()) {
      last_ = done;
      launch->done = std::move(done);
      return work;
    }
  }
  // A communicator that failed an enqueue (a peer gone: NCCL saw its socket
  // close) is done for, as after an asynchronous error: the cause is kept and
  // later work fails at once as unusable, naming it.
  fail(s);
  abort(s.message());
  launch->status = s;
  return work;
}

std::shared_ptr<Work> NcclCommunicator::send(const void* data, size_t bytes, int peer, uint32_t /*tag*/) {
  // ncclSend takes a const buffer; move() casts back only to share the path.
  return move(true, const_cast<void*>(data), bytes, peer);
}

std::shared_ptr<Work> NcclCommunicator::recv(void* data, size_t bytes, int peer, uint32_t /*tag*/) {
  return move(false, data, bytes, peer);
}

std::shared_ptr<Work> NcclCommunicator::move(bool is_send, void* data, size_t bytes, int peer) {
  const char* call = is_send ? "ncclSend" : "ncclRecv";
  if (peer < 0 || peer >= options_.world_size || peer == options_.rank) {
    auto bad = std::make_shared<Launch>(call);
    std::string why = std::string(call) + " with peer " + std::to_string(peer) + " in a group of " +
                      std::to_string(options_.world_size) + " (" + where() + ")";
    bad->status = invalid_argument(why);
    return std::make_shared<Event>(this, bad);
  }
  if (bytes == 0) return std::make_shared<Event>(this, std::make_shared<Launch>(call));
  const bool alone = !group_;
  if (alone) begin_moves();
  auto work = std::make_shared<Event>(this, group_);
  Launch& launch = *group_;
  if (launch.status.ok()) {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (aborted_.load() || !in_group_) {
      launch.status = unusable();
    } else {
      DeviceGuard g(options_.device.index);
      const ncclResult_t r = is_send ? ncclSend(data, bytes, ncclUint8, peer, comm_, stream_)
                                     : ncclRecv(data, bytes, ncclUint8, peer, comm_, stream_);
      launch.status = nccl_status(r, call, comm_);
      if (launch.status.ok()) launch.queued = true;
    }
  }
  if (alone) (void)end_moves();  // its failure is the Work's
  return work;
}

void NcclCommunicator::begin_moves() {
  if (group_) return;  // groups do not nest: the open one goes on
  group_ = std::make_shared<Launch>("ncclSend/ncclRecv group");
  group_->open = true;
  group_->stall_checked = false;
  std::lock_guard<std::mutex> lock(comm_mu_);
  if (gone_ || aborted_.load()) {
    group_->status = unusable();
    return;
  }
  group_->status = nccl_status(ncclGroupStart(), "ncclGroupStart");
  in_group_ = group_->status.ok();
}

Status NcclCommunicator::end_moves() {
  if (!group_) return Status();
  std::shared_ptr<Launch> launch = std::move(group_);
  group_.reset();
  launch->open = false;
  Status s = launch->status;
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (in_group_) {
      // Always closed, even after a failure or an abort: the group is the
      // thread's NCCL state, and comm_ is still live (abort waits for this).
      DeviceGuard g(options_.device.index);
      Status ended = nccl_status(ncclGroupEnd(), "ncclGroupEnd", comm_);
      in_group_ = false;
      if (s.ok()) s = ended;
      if (s.ok() && aborted_.load()) s = unusable();
      // NCCL connects a pair's point-to-point channels lazily, here, and may
      // wait for the peer to reach its own group: bounded by op_timeout and
      // by an abort.
      if (s.ok() && launch->queued)
        s = poll_comm(comm_, Clock::now() + options_.op_timeout, &aborted_, "ncclSend/ncclRecv group enqueue");
      if (s.ok() && launch->queued) {
        auto done = std::make_shared<Completion>();
        auto* arg = new std::shared_ptr<Completion>(done);
        s = cuda_status(cudaLaunchHostFunc(stream_, &Completion::fire, arg), "cudaLaunchHostFunc");
        if (s.ok()) {
          last_ = done;
          launch->done = std::move(done);
        } else {
          delete arg;
        }
      }
      if (abort_deferred_.load()) hand_to_reaper();
    }
  }
  if (!s.ok()) {
    // As a broadcast's failed enqueue: the communicator is done for (its
    // peers posted moves that will never be matched in order now).
    launch->status = s;
    fail(s);
    abort(s.message());
  }
  return s;
}

Status NcclCommunicator::order_after(void* stream) {
  std::lock_guard<std::mutex> lock(comm_mu_);
  if (gone_ || aborted_.load()) return unusable();
  DeviceGuard g(options_.device.index);
  cudaStream_t other = stream ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
  PC_CUDA_RETURN(cudaEventRecord(ordered_, other));
  PC_CUDA_RETURN(cudaStreamWaitEvent(stream_, ordered_, 0));
  return Status();
}

void NcclCommunicator::abort(const std::string& reason) {
  // The flag first: an enqueue polling under comm_mu_ sees it and returns,
  // so the lock below waits at most one poll.
  aborted_.store(true);
  fail(aborted(reason));
  std::lock_guard<std::mutex> lock(comm_mu_);
  if (gone_) return;
  if (in_group_) {
    abort_deferred_.store(true);  // end_moves() closes the group, then hands comm_ over
    return;
  }
  hand_to_reaper();
}

void NcclCommunicator::hand_to_reaper() {
  if (gone_) return;
  gone_ = true;
  abort_deferred_.store(false);
  reaper_.start([comm = comm_, stream = stream_, event = ordered_, index = options_.device.index, w = where()] {
    DeviceGuard g(index);
    const ncclResult_t r = ncclCommAbort(comm);
    if (r != ncclSuccess) PC_WARN("nccl (" << w << "): ncclCommAbort: " << ncclGetErrorString(r));
    cudaEventDestroy(event);
    cudaStreamDestroy(stream);
  });
}

Status NcclCommunicator::async_error() {
  {
    std::lock_guard<std::mutex> lock(err_mu_);
    if (!error_.ok()) return error_;
  }
  ncclResult_t async = ncclSuccess;
  {
    // Never waits: while an enqueue holds the lock there is nothing new to say.
    std::unique_lock<std::mutex> lock(comm_mu_, std::try_to_lock);
    if (!lock.owns_lock()) return Status();
    if (gone_) return unusable();
    if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess) return Status();
  }
  if (async == ncclSuccess || async == ncclInProgress) return Status();
  fail(nccl_status(async, "asynchronous NCCL error", comm_));
  std::lock_guard<std::mutex> lock(err_mu_);
  return error_;
}

// Connects NCCL's channels now (a 1-byte broadcast), under the init deadline,
// so that the first bucket's deadline does not include lazy connection setup.
Status warm_up(ncclComm_t comm, cudaStream_t stream, Deadline deadline) {
  void* byte = nullptr;
  PC_CUDA_RETURN(cudaMalloc(&byte, 1));
  Status s = nccl_status(ncclBroadcast(byte, byte, 1, ncclUint8, 0, comm, stream), "warm-up ncclBroadcast", comm);
  if (s.ok()) s = poll_comm(comm, deadline, nullptr, "warm-up ncclBroadcast enqueue");
  while (s.ok()) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) s = cuda_status(e, "warm-up cudaStreamQuery");
    else if (Status a = poll_comm(comm, deadline, nullptr, "warm-up ncclBroadcast"); !a.ok()) s = a;
    else if (Clock::now() >= deadline) s = timeout_error("warm-up broadcast did not finish within init_timeout");
    else std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (s.ok()) cudaFree(byte);  // else the comm is aborted first (the kernel may still run): let it go
  return s;
}

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

StatusOr<std::string> unique_id() {
  ncclUniqueId id;
  PC_NCCL_RETURN(ncclGetUniqueId(&id));
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
}

StatusOr<std::unique_ptr<Communicator>> create(const GroupOptions& group, Store& /*store*/) {
  GroupOptions options = group;
  auto resolved = resolve_device(options.device);  // a GPU named by UUID
  if (!resolved.ok()) return resolved.status();
  options.device = *resolved;
  if (!options.device.is_cuda())
    return invalid_argument("nccl backend needs a cuda device, got " + options.device.to_string());
  const int count = cuda_device_count();
  if (options.device.index >= count)
    return unavailable("no CUDA device " + options.device.to_string() + " (this process sees " +
                       std::to_string(count) + "; CUDA_VISIBLE_DEVICES renumbers them from 0)");
  if (options.bootstrap.size() != sizeof(ncclUniqueId))
    return invalid_argument("nccl bootstrap is " + std::to_string(options.bootstrap.size()) +
                            " bytes, expected an ncclUniqueId of " + std::to_string(sizeof(ncclUniqueId)));
  if (const char* b = std::getenv("NCCL_COMM_BLOCKING"); b && std::strcmp(b, "1") == 0)
    PC_WARN("NCCL_COMM_BLOCKING=1 overrides ParamCast's non-blocking NCCL communicators: creation and broadcasts "
            "can no longer be bounded by init_timeout/timeout nor aborted; unset it");
  ncclUniqueId id;
  std::memcpy(&id, options.bootstrap.data(), sizeof id);
  DeviceGuard g(options.device.index);
  cudaStream_t stream;
  PC_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t ordered = nullptr;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const Deadline deadline = Clock::now() + options.init_timeout;
  Status s = cuda_status(cudaEventCreateWithFlags(&ordered, cudaEventDisableTiming), "cudaEventCreate");
  if (s.ok())
    s = nccl_status(ncclCommInitRankConfig(&comm, options.world_size, id, options.rank, &config),
                    "ncclCommInitRankConfig");
  if (s.ok() && comm) s = poll_comm(comm, deadline, nullptr, "ncclCommInitRankConfig");
  if (s.ok() && comm) s = warm_up(comm, stream, deadline);
  if (!s.ok()) {
    if (comm) ncclCommAbort(comm);  // creation is a data-thread call: it may wait for the abort
    if (ordered) cudaEventDestroy(ordered);
    cudaStreamDestroy(stream);
    return s.with_context("nccl group of epoch " + std::to_string(options.epoch) + " (rank " +
                          std::to_string(options.rank) + " of " + std::to_string(options.world_size) + ")");
  }
  return std::unique_ptr<Communicator>(new NcclCommunicator(options, comm, stream, ordered));
}

}  // namespace paramcast::nccl_backend
