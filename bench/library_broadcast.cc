#include "bench/library_broadcast.h"

#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include <chrono>
#include <cstring>
#include <memory>

namespace paramcast::bench {

StatusOr<std::vector<double>> library_broadcast(int rank, int world, uint64_t bytes, int repeats,
                                                const std::string& dir) {
  std::vector<double> gbps;
  try {
    ::gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<::gloo::rendezvous::Context>(rank, world);
    context->setTimeout(std::chrono::seconds(300));
    ::gloo::rendezvous::FileStore store(dir);
    context->connectFullMesh(store, device);
    std::unique_ptr<uint8_t[]> buf(new uint8_t[bytes]);
    std::memset(buf.get(), rank, bytes);  // every page touched before timing
    uint32_t tag = 0;
    for (int rep = 0; rep <= repeats; ++rep) {
      ::gloo::BarrierOptions start(context);  // every rank ready: the root's clock starts with the receivers
      start.setTag(tag++);
      ::gloo::barrier(start);
      const auto t0 = std::chrono::steady_clock::now();
      ::gloo::BroadcastOptions b(context);
      b.setOutput<uint8_t>(buf.get(), bytes);
      b.setRoot(0);
      b.setTag(tag++);
      ::gloo::broadcast(b);
      ::gloo::BarrierOptions done(context);
      done.setTag(tag++);
      ::gloo::barrier(done);
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rank == 0 && rep > 0) gbps.push_back(static_cast<double>(bytes) / secs / 1e9);
    }
  } catch (const std::exception& e) {
    return unavailable("gloo::broadcast baseline (rank " + std::to_string(rank) + " of " + std::to_string(world) +
                       "): " + e.what());
  }
  return gbps;
}

}  // namespace paramcast::bench
