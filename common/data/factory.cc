// Dispatch from a GroupOptions to the backend that implements it.
#include <signal.h>

#include <mutex>

#include "common/data/gloo/gloo_factory.h"
#include "common/data/shm/segment.h"
#include "common/data/shm/shm_factory.h"
#include "common/data/split_communicator.h"
#include "paramcast/build_config.h"
#if PARAMCAST_HAVE_NCCL
#include "common/data/nccl/nccl_factory.h"
#endif

namespace paramcast {

namespace {
// The data plane's TCP writes to a peer that just died must fail with EPIPE,
// not kill the process: Gloo writes without MSG_NOSIGNAL, on its own threads
// and on the caller's. Python, the usual host, already ignores SIGPIPE; a C++
// host that left it at the default gets it ignored here, once. A handler the
// host installed is left alone.
void ignore_sigpipe_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      struct sigaction ignore {};
      ignore.sa_handler = SIG_IGN;
      sigemptyset(&ignore.sa_mask);
      sigaction(SIGPIPE, &ignore, nullptr);
    }
  });
}
}  // namespace

StatusOr<std::unique_ptr<Communicator>> create_communicator(const GroupOptions& options, Store& store,
                                                            FormationEvidence* evidence) {
  ignore_sigpipe_once();
  if (!options.local.empty()) return create_split_communicator(options, store, evidence);  // a mixed group
  switch (options.backend) {
    case Backend::kGloo:
      return gloo_backend::create(options, store, evidence);
    case Backend::kShm:
      return shm_backend::create(options, store, evidence);
    case Backend::kNccl:
#if PARAMCAST_HAVE_NCCL
      return nccl_backend::create(options, store);
#else
      return unavailable("this build has no NCCL backend (configure with -DPARAMCAST_WITH_NCCL=ON)");
#endif
  }
  return internal_error("unknown backend");
}

StatusOr<std::string> mint_bootstrap(Backend backend, uint64_t epoch) {
  if (backend == Backend::kNccl) {
#if PARAMCAST_HAVE_NCCL
    return nccl_backend::unique_id();
#else
    return unavailable("this build has no NCCL backend");
#endif
  }
  if (backend == Backend::kShm) return shm_backend::mint_bootstrap();
  return "paramcast/epoch-" + std::to_string(epoch);
}

std::string backend_unavailable_reason(Backend backend) {
  if (backend == Backend::kGloo || backend == Backend::kShm) return "";
#if PARAMCAST_HAVE_NCCL
  if (nccl_backend::cuda_device_count() == 0) return "no CUDA device on this machine";
  return "";
#else
  return "built without NCCL (PARAMCAST_WITH_NCCL=OFF or CUDA/NCCL not found)";
#endif
}

std::string point_to_point_unavailable_reason(Backend backend, bool local, const Device& device, int world) {
  if (local) return "a mixed group (data_plane.local) has no point-to-point moves: its local members read the "
                    "publisher's shared memory only";
  if (backend == Backend::kGloo)
    return device.is_cuda() ? "the gloo plane moves host memory, not " + device.to_string() + " (backend nccl does)" : "";
  if (backend == Backend::kShm) {
    if (device.is_cuda()) return "the shm plane moves point to point in host memory only, not " + device.to_string();
    if (world > shm_backend::kP2pMaxRanks) {
      std::string why = "the shm plane moves point to point in groups of up to ";
      why += std::to_string(shm_backend::kP2pMaxRanks);
      why += " ranks; this group has ";
      why += std::to_string(world);
      return why;
    }
    return "";
  }
  // NCCL: ncclSend/ncclRecv groups over a GPU's memory, round by round
  // (common/reshard/device_executor.cc).
  if (!device.is_cuda())
    return "the nccl plane moves a GPU's memory; this rank's device is " + device.to_string();
  return "";
}

}  // namespace paramcast
