// gloo-pieces-probe: can a Gloo TCP group broadcast T separately allocated
// pieces straight into separately allocated destinations faster than
// ParamCast's pack -> broadcast -> unpack? It measures, in one run, over the
// same 8 forked ranks:
//
//   raw     gloo::broadcast of one flat buffer of S bytes (the baseline);
//   pieces  a binomial tree of the same shape as gloo::broadcast, pipelined
//           per piece: every piece is its own message from the parent into
//           the piece's own allocation, forwarded to the children as soon as
//           it landed (no staging, no copy).
//
// Both are timed from the root's start until a barrier after every rank is
// done. This is the experiment behind the "separate allocations" paragraph of
// docs/PERFORMANCE.md, kept so that it can be repeated; it is not part of
// ParamCast. usage: gloo-pieces-probe [PIECES=10000] [WINDOW=256] [SIZE_MIB=1024]
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/cli.h"

namespace {

const paramcast::Tool kTool{
    .name = "gloo-pieces-probe",
    .usage = "usage: gloo-pieces-probe [PIECES=10000] [WINDOW=256] [SIZE_MIB=1024]\n"
             "\n"
             "Times, over 8 forked ranks on one machine, a Gloo broadcast of one flat buffer\n"
             "of SIZE_MIB MiB against per-piece messages (PIECES pieces, WINDOW in flight)\n"
             "through a binomial tree: the experiment behind docs/PERFORMANCE.md's\n"
             "\"separate allocations\" analysis. Not part of ParamCast.\n"
             "\n"
             "  -h, --help  print this and exit\n",
};

constexpr int kWorld = 8;
constexpr int kRepeats = 3;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void barrier(const std::shared_ptr<gloo::Context>& ctx, uint32_t tag) {
  gloo::BarrierOptions b(ctx);
  b.setTag(tag);
  gloo::barrier(b);
}

int run_rank(int rank, const std::string& dir, size_t bytes, int pieces, int window) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, kWorld);
  gloo::rendezvous::FileStore store(dir);
  ctx->connectFullMesh(store, device);

  const size_t piece = bytes / pieces;
  std::vector<std::unique_ptr<char[]>> owned;
  for (int i = 0; i < pieces; ++i) {
    owned.emplace_back(new char[piece]);
    std::memset(owned.back().get(), rank, piece);  // touch every page before timing
  }
  std::unique_ptr<char[]> flat(new char[bytes]);
  std::memset(flat.get(), rank, bytes);

  // The binomial tree rooted at 0 that gloo::broadcast uses.
  int parent = -1;
  std::vector<int> children;
  const int dim = 3;  // log2(kWorld)
  const int low = rank == 0 ? dim : __builtin_ctz(rank);
  if (rank != 0) parent = rank & ~(1 << low);
  for (int i = low - 1; i >= 0; --i) children.push_back(rank | (1 << i));

  uint32_t tag = 0;
  for (int rep = 0; rep < kRepeats; ++rep) {
    const double t0 = now();
    {
      gloo::BroadcastOptions o(ctx);
      o.setOutput<uint8_t>(reinterpret_cast<uint8_t*>(flat.get()), bytes);
      o.setRoot(0);
      o.setTag(tag++);
      gloo::broadcast(o);
    }
    barrier(ctx, tag++);
    const double t1 = now();

    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> bufs;
    for (int i = 0; i < pieces; ++i) bufs.push_back(ctx->createUnboundBuffer(owned[i].get(), piece));
    const uint64_t slot = gloo::Slot::build(0x40, tag++);
    int posted = 0;
    for (int i = 0; i < pieces; ++i) {
      if (parent >= 0) {
        for (; posted < pieces && posted < i + window; ++posted) bufs[posted]->recv(parent, slot + posted);
        bufs[i]->waitRecv();
      }
      for (int c : children) bufs[i]->send(c, slot + i);
    }
    for (int i = 0; i < pieces; ++i)
      for (size_t c = 0; c < children.size(); ++c) bufs[i]->waitSend();
    barrier(ctx, tag++);
    const double t2 = now();
    if (rank == 0) {
      std::printf("repeat %d: raw %.3f GB/s  pieces (%d x %zu B) %.3f GB/s  ratio %.2f\n", rep,
                  bytes / (t1 - t0) / 1e9, pieces, piece, bytes / (t2 - t1) / 1e9, (t1 - t0) / (t2 - t1));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const paramcast::Flags flags = paramcast::parse_flags(argc, argv, 1, kTool);
  if (auto code = paramcast::finish_flags(flags, kTool)) return *code;
  const auto& args = flags.positional;
  if (args.size() > 3) return paramcast::usage_error(kTool, "unexpected argument '" + args[3] + "'");
  const int pieces = args.size() > 0 ? std::atoi(args[0].c_str()) : 10000;
  const int window = args.size() > 1 ? std::atoi(args[1].c_str()) : 256;
  const size_t bytes = (args.size() > 2 ? std::strtoull(args[2].c_str(), nullptr, 10) : 1024) << 20;
  if (pieces < 1 || window < 1 || bytes < static_cast<size_t>(pieces))
    return paramcast::usage_error(kTool, "PIECES, WINDOW and SIZE_MIB must be at least 1, PIECES at most SIZE_MIB MiB");
  char tmpl[] = "/tmp/gloo-pieces-probe-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  std::printf("gloo-pieces-probe: %d ranks, %zu MiB, %d pieces, window %d\n", kWorld, bytes >> 20, pieces, window);
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < kWorld; ++r) {
    const pid_t pid = fork();
    if (pid == 0) _exit(run_rank(r, dir, bytes, pieces, window));
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int st = 0;
    waitpid(pid, &st, 0);
    failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  std::string rm = "rm -rf '" + dir + "'";
  if (std::system(rm.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir.c_str());
  return failed ? 1 : 0;
}
