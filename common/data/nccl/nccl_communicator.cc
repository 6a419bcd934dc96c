// NCCL data plane. The communicator is created non-blocking
// (ncclCommInitRankConfig with blocking = 0) so that creation and every
// collective are bounded by deadlines: we poll ncclCommGetAsyncError and call
// ncclCommAbort when a deadline passes or abort() is requested. Each
// communicator owns one CUDA stream; a Work is a CUDA event on it.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/data/nccl/nccl_check.h"
#include "common/data/nccl/nccl_factory.h"
#include "common/log.h"

namespace paramcast::nccl_backend {
namespace {

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

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(const GroupOptions& options, ncclComm_t comm, cudaStream_t stream)
      : options_(options), comm_(comm), stream_(stream) {}

  ~NcclCommunicator() override {
    cudaSetDevice(options_.device.index);
    if (!aborted_.load()) {
      // Finalize flushes outstanding work; bounded, then abort if stuck.
      const ncclResult_t r = ncclCommFinalize(comm_);
      if ((r == ncclSuccess || r == ncclInProgress) &&
          poll_comm(comm_, Clock::now() + std::chrono::seconds(5), nullptr, "ncclCommFinalize").ok())
        ncclCommDestroy(comm_);
      else
        ncclCommAbort(comm_);
    } else if (!comm_aborted_.exchange(true)) {
      ncclCommAbort(comm_);
    }
    cudaStreamDestroy(stream_);
  }

  std::shared_ptr<Work> broadcast(void* data, size_t bytes, int root) override {
    auto work = std::make_shared<Event>(this);
    if (bytes == 0) return work;
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok()) {
      work->status = aborted("communicator of epoch " + std::to_string(options_.epoch) +
                             " is unusable: " + error_.to_string());
      return work;
    }
    cudaSetDevice(options_.device.index);
    Status s = nccl_status(ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, stream_), "ncclBroadcast", comm_);
    if (s.ok()) s = poll_comm(comm_, Clock::now() + options_.op_timeout, &aborted_, "ncclBroadcast enqueue");
    if (s.ok()) s = cuda_status(cudaEventCreateWithFlags(&work->event, cudaEventDisableTiming), "cudaEventCreate");
    if (s.ok()) s = cuda_status(cudaEventRecord(work->event, stream_), "cudaEventRecord");
    if (!s.ok()) {
      error_ = s;
      work->status = s;
    }
    return work;
  }

  void abort(const std::string& reason) override {
    // First the flag: a broadcast() polling its enqueue under mu_ sees it and
    // returns, so the lock below is not held for a whole deadline.
    aborted_.store(true);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.ok()) error_ = aborted(reason);
    }
    if (!comm_aborted_.exchange(true)) {
      cudaSetDevice(options_.device.index);
      ncclCommAbort(comm_);
    }
  }

  Status async_error() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok() || comm_aborted_.load()) return error_;
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
      error_ = nccl_status(async, "asynchronous NCCL error", comm_);
    return error_;
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  Device device() const override { return options_.device; }

 private:
  struct Event : Work {
    explicit Event(NcclCommunicator* c) : comm(c) {}
    ~Event() override {
      if (event) cudaEventDestroy(event);
    }
    Status wait(Deadline deadline) override {
      if (!status.ok() || !event) return status;
      for (;;) {
        cudaError_t e = cudaEventQuery(event);
        if (e == cudaSuccess) return Status();
        if (e != cudaErrorNotReady) return cuda_status(e, "cudaEventQuery");
        if (comm->aborted_.load()) return aborted("broadcast aborted: " + comm->async_error().message());
        Status async = comm->async_error();
        if (!async.ok()) {
          comm->abort(async.message());
          return async;
        }
        if (Clock::now() >= deadline) {
          comm->abort("broadcast deadline passed");
          return timeout_error("ncclBroadcast did not finish before its deadline (epoch " +
                               std::to_string(comm->options_.epoch) + ", rank " +
                               std::to_string(comm->options_.rank) + "); ncclCommAbort called");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
    NcclCommunicator* comm;
    cudaEvent_t event = nullptr;
    Status status;
  };

  GroupOptions options_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  std::mutex mu_;
  Status error_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> comm_aborted_{false};
};

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

StatusOr<std::unique_ptr<Communicator>> create(const GroupOptions& options, Store& /*store*/) {
  if (!options.device.is_cuda())
    return invalid_argument("nccl backend needs a cuda device, got " + options.device.to_string());
  const int count = cuda_device_count();
  if (options.device.index >= count)
    return unavailable("no CUDA device " + options.device.to_string() + " (this machine has " +
                       std::to_string(count) + " visible)");
  if (options.bootstrap.size() != sizeof(ncclUniqueId))
    return invalid_argument("nccl bootstrap is " + std::to_string(options.bootstrap.size()) +
                            " bytes, expected an ncclUniqueId of " + std::to_string(sizeof(ncclUniqueId)));
  ncclUniqueId id;
  std::memcpy(&id, options.bootstrap.data(), sizeof id);
  PC_CUDA_RETURN(cudaSetDevice(options.device.index));
  cudaStream_t stream;
  PC_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  Status s = nccl_status(ncclCommInitRankConfig(&comm, options.world_size, id, options.rank, &config),
                         "ncclCommInitRankConfig");
  if (s.ok() && comm) s = poll_comm(comm, Clock::now() + options.init_timeout, nullptr, "ncclCommInitRankConfig");
  if (!s.ok()) {
    if (comm) ncclCommAbort(comm);
    cudaStreamDestroy(stream);
    return s.with_context("nccl group of epoch " + std::to_string(options.epoch) + " (rank " +
                          std::to_string(options.rank) + " of " + std::to_string(options.world_size) + ")");
  }
  return std::unique_ptr<Communicator>(new NcclCommunicator(options, comm, stream));
}

}  // namespace paramcast::nccl_backend
