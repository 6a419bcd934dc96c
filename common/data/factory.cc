// Dispatch from a GroupOptions to the backend that implements it.
#include "common/data/gloo/gloo_factory.h"
#include "paramcast/build_config.h"
#if PARAMCAST_HAVE_NCCL
#include "common/data/nccl/nccl_factory.h"
#endif

namespace paramcast {

StatusOr<std::unique_ptr<Communicator>> create_communicator(const GroupOptions& options, Store& store) {
  switch (options.backend) {
    case Backend::kGloo:
      return gloo_backend::create(options, store);
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
  return "paramcast/epoch-" + std::to_string(epoch);
}

std::string backend_unavailable_reason(Backend backend) {
  if (backend == Backend::kGloo) return "";
#if PARAMCAST_HAVE_NCCL
  if (nccl_backend::cuda_device_count() == 0) return "no CUDA device on this machine";
  return "";
#else
  return "built without NCCL (PARAMCAST_WITH_NCCL=OFF or CUDA/NCCL not found)";
#endif
}

}  // namespace paramcast
