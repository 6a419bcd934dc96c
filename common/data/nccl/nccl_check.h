// The one place NCCL and CUDA results become Statuses. Every NCCL and CUDA
// call in ParamCast goes through PC_NCCL_RETURN / PC_CUDA_RETURN, which carry
// ncclGetErrorString + ncclGetLastError (or cudaGetErrorString) and the call.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "common/status.h"

namespace paramcast::nccl_backend {

inline Status nccl_status(ncclResult_t r, const char* call, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess || r == ncclInProgress) return Status();
  std::string msg = std::string(call) + ": " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last && *last) msg += " (" + std::string(last) + ")";
  const Code code = r == ncclRemoteError ? Code::kPeerLost
                    : r == ncclInvalidArgument || r == ncclInvalidUsage ? Code::kInvalidArgument
                                                                        : Code::kInternal;
  return Status(code, msg);
}

inline Status cuda_status(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return Status();
  return internal_error(std::string(call) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

}  // namespace paramcast::nccl_backend

#define PC_NCCL_RETURN(call)                                                              \
  do {                                                                                    \
    ::paramcast::Status pc_ns_ = ::paramcast::nccl_backend::nccl_status((call), #call);    \
    if (!pc_ns_.ok()) return pc_ns_;                                                      \
  } while (0)
#define PC_CUDA_RETURN(call)                                                              \
  do {                                                                                    \
    ::paramcast::Status pc_cs_ = ::paramcast::nccl_backend::cuda_status((call), #call);    \
    if (!pc_cs_.ok()) return pc_cs_;                                                      \
  } while (0)
