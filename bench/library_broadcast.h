// The library baseline of paramcast-bench on the Gloo backend: gloo::broadcast,
// libgloo's own collective, of one flat host buffer over the same TCP
// transport and loopback as ParamCast's Gloo data plane. ParamCast's Gloo
// backend runs its own chunked, pipelined tree (so that a slow link is told
// from a dead one); this is the figure it must not fall behind.
//
// Every rank of the bench calls library_broadcast() with the same arguments
// and its own rank, at the same point of the run.
//
// Thread-safety: one call per process at a time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace paramcast::bench {

// Forms a Gloo group of `world` ranks through a gloo FileStore in `dir` (which
// must exist), then broadcasts `bytes` from rank 0 repeats + 1 times, each
// timed from the root's start to a barrier after every rank has the bytes.
// Rank 0 gets GB/s per repeat, the first (warm-up) left out; others get none.
StatusOr<std::vector<double>> library_broadcast(int rank, int world, uint64_t bytes, int repeats,
                                                const std::string& dir);

}  // namespace paramcast::bench
