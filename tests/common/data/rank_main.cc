// dataplane_rank: one rank of the data-plane conformance suite, run as its own
// process. Forms a communicator (FileStore rendezvous in --store), runs
// broadcasts of the given sizes from rank 0, verifies every byte.
// Flags: --stall-ms (stall_timeout), --silent-rank, --abort-rank, --mode p2p and
// --scribble-rank (below).
// Exit: 0 ok, 1 wrong bytes, 2 usage, 3 broadcast failed (and the
// communicator then refused further work as it must), 4 it did not.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>
#include <sstream>
#include <vector>

#include "common/cli.h"
#include "common/data/communicator.h"
#include "common/data/device_memory.h"
#include "common/data/file_store.h"
#include "common/data/shm/segment.h"

using namespace paramcast;

namespace {
std::string unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  return out;
}

uint8_t pattern(uint64_t size, int rep, uint64_t i) { return static_cast<uint8_t>((i * 131 + size * 7 + rep * 29) >> 3); }

// A hostile shm reader: finds the group's segment in its own mappings (as any
// process holding it can) and claims, in the channel from rank 0 to itself,
// that it posted far more receives than it did.
bool scribble_posted_count(int rank, int world, uint64_t slot_bytes) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (!maps) return false;
  char line[512];
  unsigned long begin = 0;
  while (std::fgets(line, sizeof line, maps))
    if (std::strstr(line, "memfd:paramcast-shm")) {
      std::sscanf(line, "%lx-", &begin);
      break;
    }
  std::fclose(maps);
  if (!begin) return false;
  using namespace shm_backend;
  auto* posted = reinterpret_cast<std::atomic<uint64_t>*>(begin + kHeaderBytes + kSlots * slot_bytes +
                                                          static_cast<uint64_t>(rank) * kP2pChannelBytes);
  (void)world;  // the channel (0, rank) is number 0 * world + rank
  for (int i = 0; i < 200; ++i) {
    posted->store(1ull << 40);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}
}  // namespace

int main(int argc, char** argv) {
  Flags f = parse_flags(argc, argv, 1);
  GroupOptions g;
  g.backend = f.get("backend") == "nccl" ? Backend::kNccl : f.get("backend") == "shm" ? Backend::kShm : Backend::kGloo;
  g.rank = std::atoi(f.get("rank").c_str());
  g.world_size = std::atoi(f.get("world").c_str());
  g.epoch = 1;
  g.bootstrap = unhex(f.get("bootstrap"));
  g.device = parse_device(f.get("device", "cpu")).value();
  g.op_timeout = std::chrono::milliseconds(std::atoi(f.get("timeout-ms", "30000").c_str()));
  g.init_timeout = std::chrono::seconds(60);
  // shm: slots far smaller than the suite's broadcasts, so that a reader that
  // stops holds every other one back within a few chunks (a deployment's
  // slots are a bucket each, its updates many buckets).
  g.shm_slot_bytes = 4 << 20;
  if (f.has("stall-ms")) g.stall_timeout = std::chrono::milliseconds(std::atoi(f.get("stall-ms").c_str()));
  for (int r = 0; r < g.world_size; ++r) g.members.push_back(r == 0 ? "publisher" : "worker-" + std::to_string(r));
  const int repeat = std::atoi(f.get("repeat", "1").c_str());
  std::vector<uint64_t> sizes;
  std::stringstream ss(f.get("sizes"));
  for (std::string s; std::getline(ss, s, ',');) sizes.push_back(std::stoull(s));
  FileStore store(f.get("store"));
  auto comm = create_communicator(g, store);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", g.rank, comm.status().to_string().c_str());
    return 3;
  }
  auto mem = create_device_memory(g.device).value();
  std::printf("rank %d: ready\n", g.rank);
  std::fflush(stdout);
  // --abort-rank R --abort-after-ms T: rank R calls abort() T ms after
  // "ready", from a second thread, while the root holds its first broadcast
  // back (--root-idle-ms) so that every other rank is blocked receiving.
  std::thread aborter;
  if (f.has("abort-rank") && std::atoi(f.get("abort-rank").c_str()) == g.rank) {
    const int after = std::atoi(f.get("abort-after-ms", "1000").c_str());
    Communicator* c = comm.value().get();
    aborter = std::thread([c, after, rank = g.rank] {
      std::this_thread::sleep_for(std::chrono::milliseconds(after));
      const auto t0 = Clock::now();
      c->abort("rank " + std::to_string(rank) + " was told to abort");
      std::printf("rank %d: abort() returned in %.3f s\n", rank,
                  std::chrono::duration<double>(Clock::now() - t0).count());
      std::fflush(stdout);
    });
  }
  // --silent-rank R: rank R joins the group but never takes part in a
  // broadcast (a live peer that makes no progress), until killed.
  if (f.has("silent-rank") && std::atoi(f.get("silent-rank").c_str()) == g.rank) {
    std::printf("rank %d: silent\n", g.rank);
    std::fflush(stdout);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  if (g.rank == 0 && f.has("root-idle-ms"))
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(f.get("root-idle-ms").c_str())));
  // Prints when the communicator first reports an error, on the machine's
  // monotonic clock, so a test can time the data plane itself, whatever the
  // main thread is busy with.
  auto monotonic_ns = [] {
    return static_cast<long long>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count());
  };
  std::atomic<bool> done{false};
  std::thread monitor([&, c = comm.value().get()] {
    for (;;) {
      const bool last = done;  // one more look after the main thread is done
      Status e = c->async_error();
      if (!e.ok()) {
        std::printf("rank %d: async error at %lld ns\n", g.rank, monotonic_ns());
        std::fflush(stdout);
        return;
      }
      if (last) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  struct Joiner {
    std::thread& t;
    std::thread& m;
    std::atomic<bool>& done;
    ~Joiner() {
      done = true;
      if (t.joinable()) t.join();
      if (m.joinable()) m.join();
    }
  } joiner{aborter, monitor, done};
  // --mode p2p: instead of broadcasts, every rank sends each size to every other
  // rank and receives it from each (point-to-point), verifying every byte; "first exchange issued at" stamps the start.
  if (f.get("mode") == "p2p") {
    const int w = g.world_size;
    auto payload = [](int from, int to, uint64_t size, int rep, uint64_t i) {
      return static_cast<uint8_t>(pattern(size, rep, i) ^ (from * 17 + to * 5));
    };
    bool first_exchange = true;
    // --scribble-rank R (shm): rank R writes its hostile count from a second
    // thread while every rank exchanges.
    std::thread scribbler;
    struct JoinScribbler {
      std::thread& t;
      ~JoinScribbler() {
        if (t.joinable()) t.join();
      }
    } join_scribbler{scribbler};
    if (f.has("scribble-rank") && std::atoi(f.get("scribble-rank").c_str()) == g.rank)
      scribbler = std::thread([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        std::printf("rank %d: scribbled %s\n", g.rank,
                    scribble_posted_count(g.rank, g.world_size, g.shm_slot_bytes) ? "its posted count" : "nothing");
        std::fflush(stdout);
      });
    // The buffers are the communicator's memory (a GPU's on NCCL, filled
    // and checked through host copies; host memory in place, so that a
    // sanitizer build issues its first exchange as soon as before); every
    // move of an exchange is one group (begin_moves/end_moves), as NCCL needs.
    const size_t peers = static_cast<size_t>(w);
    const bool on_host = !g.device.is_cuda();
    for (uint64_t size : sizes) {
      std::vector<void*> out(peers, nullptr), in(peers, nullptr);
      for (int q = 0; q < w; ++q)
        if (q != g.rank) {
          out[static_cast<size_t>(q)] = mem->allocate(size).value();
          in[static_cast<size_t>(q)] = mem->allocate(size).value();
        }
      std::vector<uint8_t> host(on_host ? 0 : size);
      for (int rep = 0; rep < repeat; ++rep) {
        std::vector<std::shared_ptr<Work>> works;
        for (int q = 0; q < w; ++q) {
          if (q == g.rank) continue;
          auto* o = on_host ? static_cast<uint8_t*>(out[static_cast<size_t>(q)]) : host.data();
          for (uint64_t i = 0; i < size; ++i) o[i] = payload(g.rank, q, size, rep, i);
          if (!on_host) (void)mem->copy(out[static_cast<size_t>(q)], host.data(), size);
          if (on_host) {
            std::memset(in[static_cast<size_t>(q)], 0xAB, size);
          } else {
            std::fill(host.begin(), host.end(), uint8_t{0xAB});
            (void)mem->copy(in[static_cast<size_t>(q)], host.data(), size);
          }
        }
        if (first_exchange) {
          std::printf("rank %d: first exchange issued at %lld ns\n", g.rank, monotonic_ns());
          std::fflush(stdout);
          first_exchange = false;
        }
        comm.value()->begin_moves();
        for (int q = 0; q < w; ++q) {
          if (q == g.rank) continue;
          works.push_back(comm.value()->recv(in[static_cast<size_t>(q)], size, q, static_cast<uint32_t>(rep * w + q)));
          works.push_back(
              comm.value()->send(out[static_cast<size_t>(q)], size, q, static_cast<uint32_t>(rep * w + g.rank)));
        }
        Status launched = comm.value()->end_moves();
        for (auto& work : works) {
          Status st = launched.ok() ? work->wait(Clock::now() + g.op_timeout + std::chrono::seconds(1)) : launched;
          if (st.ok()) continue;
          std::printf("rank %d: exchange of %llu bytes failed: %s\n", g.rank, static_cast<unsigned long long>(size),
                      st.to_string().c_str());
          Status again = comm.value()->send(out[static_cast<size_t>((g.rank + 1) % w)], 1, (g.rank + 1) % w, 999999)
                             ->wait(Clock::now() + std::chrono::seconds(1));
          std::printf("rank %d: next send: %s\n", g.rank, again.to_string().c_str());
          std::fflush(stdout);
          return again.code() == Code::kAborted ? 3 : 4;
        }
        for (int q = 0; q < w; ++q) {
          if (q == g.rank) continue;
          const uint8_t* got = static_cast<const uint8_t*>(in[static_cast<size_t>(q)]);
          if (!on_host) {
            (void)mem->copy(host.data(), got, size);
            got = host.data();
          }
          for (uint64_t i = 0; i < size; ++i)
            if (got[i] != payload(q, g.rank, size, rep, i)) {
              std::printf("rank %d: from rank %d, size %llu rep %d: byte %llu is wrong\n", g.rank, q,
                          static_cast<unsigned long long>(size), rep, static_cast<unsigned long long>(i));
              return 1;
            }
        }
      }
      for (size_t q = 0; q < peers; ++q) {
        if (out[q]) mem->release(out[q]);
        if (in[q]) mem->release(in[q]);
      }
    }
    std::printf("rank %d: all point-to-point moves verified\n", g.rank);
    return 0;
  }
  // Prints when the first broadcast is issued, so a test can time a failure
  // from it (filling the buffers below takes seconds with 8 ranks of a
  // sanitizer build sharing 2 cores).
  bool first = true;
  for (uint64_t size : sizes) {
    std::vector<uint8_t> host(size);
    void* buf = size ? mem->allocate(size).value() : nullptr;
    for (int rep = 0; rep < repeat; ++rep) {
      for (uint64_t i = 0; i < size; ++i) host[i] = g.rank == 0 ? pattern(size, rep, i) : 0xAB;
      (void)mem->copy(buf, host.data(), size);
      if (first) {
        std::printf("rank %d: first broadcast issued at %lld ns\n", g.rank, monotonic_ns());
        std::fflush(stdout);
        first = false;
      }
      Status s = comm.value()->broadcast(buf, size, 0)->wait(Clock::now() + g.op_timeout + std::chrono::seconds(1));
      if (!s.ok()) {
        std::printf("rank %d: broadcast of %llu bytes failed: %s\n", g.rank, static_cast<unsigned long long>(size),
                    s.to_string().c_str());
        Status again = comm.value()->broadcast(buf, size ? size : 1, 0)->wait(Clock::now() + std::chrono::seconds(1));
        std::printf("rank %d: next broadcast: %s\n", g.rank, again.to_string().c_str());
        std::fflush(stdout);
        return again.code() == Code::kAborted ? 3 : 4;
      }
      (void)mem->copy(host.data(), buf, size);
      for (uint64_t i = 0; i < size; ++i)
        if (host[i] != pattern(size, rep, i)) {
          std::printf("rank %d: size %llu rep %d: byte %llu is %u, expected %u\n", g.rank,
                      static_cast<unsigned long long>(size), rep, static_cast<unsigned long long>(i), host[i],
                      pattern(size, rep, i));
          return 1;
        }
    }
    if (buf) mem->release(buf);
  }
  std::printf("rank %d: all broadcasts verified\n", g.rank);
  return 0;
}
