// The many-sender plan run for real: trainer ranks and engine ranks as
// separate processes in one Gloo group (point-to-point moves over TCP),
// each holding or wanting its part of a LLaMA-shaped model; every engine
// verifies every element it wanted, and receives exactly those bytes.
#include <gtest/gtest.h>

#include <unistd.h>

#include "common/data/communicator.h"
#include "tests/support/process.h"
#include "tests/support/sanitizer.h"

namespace paramcast {
namespace {

using test::Process;

struct Job {
  std::string layout;
  int senders, replicas, tp;
  bool forward = true;
  std::string mode = "plan";  // or "funnel": gather on rank 0, then publish from it (the baseline)
  int delta_steps = 0;        // versions sent as deltas after the first
  int corrupt_base = -1;      // the rank whose buffers stop holding the base before the first delta
  uint64_t staging_limit = 0;  // a sender's packed pieces and encodings in flight (RunOptions::staging_limit)
  // "host": every move posted at once; "cpu": round by round over a host
  // DeviceMemory (the device path's logic, on Gloo); "cuda": over NCCL, the
  // buffers on the GPU.
  std::string memory = "host";
  bool checksums = false;
  int corrupt_rank = -1;  // its first piece leaves with a byte flipped
  int forge_rank = -1;    // the same, with a checksum that matches the flipped bytes
  int layers = 2, hidden = 64;  // the model: 5 tensors a layer, 2 more
  int repeats = 0;              // whole versions after the first, the rank's schedule kept (RunOptions::schedule)
};

std::string hex_of(const std::string& bytes) {
  std::string out;
  char two[3];
  for (unsigned char c : bytes) {
    std::snprintf(two, sizeof two, "%02x", c);
    out += two;
  }
  return out;
}

// Runs the job; returns each rank's output and exit code.
std::vector<std::pair<std::string, int>> run_raw(const Job& job) {
  const std::string dir = test::make_temp_dir("paramcast-reshard");
  const int world = job.senders + job.replicas * job.tp;
  std::vector<std::unique_ptr<Process>> ranks;
  const std::string prefix = "reshard-" + std::to_string(getpid()) + "-" + job.layout;
  const bool cuda = job.memory == "cuda";
  std::string nccl_id;
  if (cuda) {
    auto id = mint_bootstrap(Backend::kNccl, 1);
    EXPECT_TRUE(id.ok()) << id.status().to_string();
    if (id.ok()) nccl_id = hex_of(*id);
  }
  const int gpus = std::max(1, test::cuda_devices());
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args = {"--rank", std::to_string(r), "--senders", std::to_string(job.senders),
                                     "--replicas", std::to_string(job.replicas), "--tp", std::to_string(job.tp),
                                     "--layout", job.layout, "--forward", job.forward ? "1" : "0", "--mode", job.mode,
                                     "--store", dir, "--bootstrap", prefix, "--delta-steps",
                                     std::to_string(job.delta_steps), "--corrupt-base",
                                     std::to_string(job.corrupt_base), "--staging-limit",
                                     std::to_string(job.staging_limit), "--memory", job.memory, "--checksums",
                                     job.checksums ? "1" : "0", "--corrupt-rank", std::to_string(job.corrupt_rank),
                                     "--forge-rank", std::to_string(job.forge_rank), "--layers",
                                     std::to_string(job.layers), "--hidden", std::to_string(job.hidden),
                                     "--repeats", std::to_string(job.repeats)};
    std::vector<std::string> env;
    if (cuda) {
      args.insert(args.end(), {"--bootstrap-hex", nccl_id, "--device", "cuda:" + std::to_string(r % gpus)});
      // Ranks sharing a GPU each report their own host to NCCL.
      if (gpus < world) env.push_back("NCCL_HOSTID=paramcast-reshard-rank-" + std::to_string(r));
    }
    ranks.push_back(Process::start(test::binary("reshard_rank"), args, env));
  }
  std::vector<std::pair<std::string, int>> out;
  for (auto& p : ranks) {
    auto code = p->wait_for(std::chrono::seconds(180));
    EXPECT_TRUE(code.has_value()) << "rank hung:\n" << p->output();
    out.emplace_back(p->output(), code.value_or(-1));
  }
  test::remove_tree(dir);
  return out;
}

// Runs the job, every rank expected to verify what it wanted; returns each rank's output.
std::vector<std::string> run(const Job& job) {
  std::vector<std::string> out;
  for (auto& [text, code] : run_raw(job)) {
    EXPECT_EQ(code, 0) << text;
    EXPECT_NE(text.find("verified"), std::string::npos) << text;
    out.push_back(text);
  }
  return out;
}

// The number after `key` in the line of `out` that starts with `line`.
uint64_t figure(const std::string& out, const std::string& line, const std::string& key) {
  const auto at = out.find(line);
  if (at == std::string::npos) return ~0ull;
  const auto k = out.find(key, at);
  if (k == std::string::npos || out.find('\n', at) < k) return ~0ull;
  return std::stoull(out.substr(k + key.size()));
}

// Runs a job with a corrupted piece: no rank keeps wrong bytes unreported
// (exit 1), and some rank fails DATA_CORRUPT (exit 3) saying each of `says`.
void expect_caught(const Job& job, const std::vector<std::string>& says) {
  bool caught = false;
  for (auto& [text, code] : run_raw(job)) {
    EXPECT_NE(code, 1) << "wrong bytes that no check caught:\n" << text;
    if (text.find("DATA_CORRUPT") == std::string::npos) continue;
    caught = true;
    EXPECT_EQ(code, 3) << text;
    for (const auto& s : says) EXPECT_NE(text.find(s), std::string::npos) << text;
  }
  EXPECT_TRUE(caught) << "no rank reported the corrupted piece";
}

// "received N, wanted M" of an engine's output.
std::pair<uint64_t, uint64_t> received_wanted(const std::string& out) {
  const auto r = out.find("received "), w = out.find("wanted ");
  if (r == std::string::npos || w == std::string::npos) return {0, 1};
  return {std::stoull(out.substr(r + 9)), std::stoull(out.substr(w + 7))};
}

TEST(ReshardExecTest, FsdpShardsFromFourRanksToTwoWholeEngines) {
  auto out = run({"fsdp", 4, 2, 1});
  for (size_t r = 4; r < out.size(); ++r) {
    auto [got, want] = received_wanted(out[r]);
    EXPECT_EQ(got, want) << out[r];
  }
}

// Megatron-style trainer (column weights by rows, row weights by columns)
// to 2 replicas x TP=2: each engine rank receives its slices only, and
// dim-1 slices are packed and unpacked on the way.
TEST(ReshardExecTest, MegatronShardsToTensorParallelEnginesReceiveTheirSlicesOnly) {
  auto out = run({"megatron", 2, 2, 2});
  uint64_t whole = 0;
  for (size_t r = 2; r < out.size(); ++r) {
    auto [got, want] = received_wanted(out[r]);
    EXPECT_EQ(got, want) << out[r];
    whole = std::max(whole, want);
  }
  EXPECT_GT(whole, 0u);
}

TEST(ReshardExecTest, PipelineStagesToTensorParallelEngines) {
  auto out = run({"pipeline", 2, 1, 2});
  for (size_t r = 2; r < out.size(); ++r) {
    auto [got, want] = received_wanted(out[r]);
    EXPECT_EQ(got, want) << out[r];
  }
}

TEST(ReshardExecTest, WithoutForwardingEverySenderFeedsEveryReplica) {
  auto out = run({"fsdp", 3, 2, 2, false});
  for (size_t r = 3; r < out.size(); ++r) {
    auto [got, want] = received_wanted(out[r]);
    EXPECT_EQ(got, want) << out[r];
  }
}

// The benchmark's baseline (bench/reshard_bench.py): rank 0 gathers every
// tensor, then sends it whole to each engine; bit-exact too.
TEST(ReshardExecTest, GatherThenPublishBaselineIsBitExact) {
  auto out = run({"fsdp", 3, 2, 1, false, "funnel"});
  EXPECT_NE(out[0].find("link out"), std::string::npos) << out[0];
}

// Deltas per piece: after a dense first version, each trainer rank sends
// only the elements of its pieces that changed (about 1 in 50), engines
// apply them onto the slices they hold (dim-1 slices packed, changed,
// unpacked; pieces several engines want forwarded as encoded) and end
// bit-exact at every version, each link carrying a small fraction of the
// dense bytes; each sender's baseline is the bytes it sends, not the model.
TEST(ReshardExecTest, DeltasPerPieceMoveOnlyChangedElementsIntoSlicesBitExact) {
  Job job{"megatron", 2, 2, 2};
  job.delta_steps = 2;
  job.staging_limit = 16384;  // a window far below a shard: senders wait for their oldest sends
  auto out = run(job);
  for (int v = 2; v <= 3; ++v) {
    const std::string step = "delta v" + std::to_string(v) + ":";
    for (size_t r = 0; r < out.size(); ++r) {
      const bool sender = r < 2;
      const auto [got, want] = received_wanted(out[r]);  // the dense version's figures
      const uint64_t dense_out = figure(out[r], "rank " + std::to_string(r) + ": sent ", "sent ");
      const uint64_t wire = figure(out[r], "rank " + std::to_string(r) + ": " + step,
                                   sender ? "wire out " : "wire in ");
      ASSERT_NE(wire, ~0ull) << out[r];
      // About 1 element in 50 changed: a delta of a few percent of the bytes
      // (indices and values); under a fifth even where pieces are small.
      if (sender) EXPECT_LT(wire * 5, dense_out) << out[r];
      else EXPECT_LT(wire * 5, got) << out[r];
      EXPECT_GT(wire, 0u) << out[r];
      (void)want;
      if (sender) {
        EXPECT_EQ(figure(out[r], "rank " + std::to_string(r) + ": " + step, "baseline "), dense_out) << out[r];
        // No piece went dense: each had its baseline at the version before.
        EXPECT_NE(out[r].find(step + " wire out " + std::to_string(wire) + ", wire in 0; "), std::string::npos);
        const auto line = out[r].substr(out[r].find(step));
        EXPECT_NE(line.substr(0, line.find('\n')).find(" 0 dense,"), std::string::npos) << out[r];
      }
    }
  }
}

// Forwards along three replicas from two holders, deltas, and senders held
// to a small staging window: each forward's receiver takes its holder's
// hash after all its moves, as the holder sends them after all its own, so
// the hashes never hold up a move (a holder that sent them with its piece
// could wait, for its window, on a send queued behind one its receiver
// takes rounds later: this job hung until its deadline so).
TEST(ReshardExecTest, HoldersHashesForChainsOfThreeNeverHoldUpAWindowedSender) {
  Job job{"megatron", 2, 3, 2};
  job.delta_steps = 2;
  job.staging_limit = 4096;
  auto out = run(job);
  for (size_t r = 2; r < out.size(); ++r) {
    auto [got, want] = received_wanted(out[r]);
    EXPECT_EQ(got, want) << out[r];
    EXPECT_NE(out[r].find("delta v3:"), std::string::npos) << out[r];
  }
}

// An engine whose bytes are not the base version any more gets the delta
// applied onto other bytes: the hash that comes with each piece catches it,
// and the engine's run fails DATA_CORRUPT naming the piece and its sender
// rather than keeping wrong weights.
TEST(ReshardExecTest, ADeltaOntoBytesThatAreNotTheBaseIsCaughtByTheHash) {
  Job job{"fsdp", 2, 1, 1};
  job.delta_steps = 1;
  job.corrupt_base = 2;
  auto out = run_raw(job);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[2].second, 3) << out[2].first;
  EXPECT_NE(out[2].first.find("DATA_CORRUPT"), std::string::npos) << out[2].first;
  EXPECT_NE(out[2].first.find("were not that version"), std::string::npos) << out[2].first;
  EXPECT_NE(out[2].first.find("from rank "), std::string::npos) << out[2].first;
}

// Many small tensors (2,002 of 32 to 4,096 bytes, FSDP shards of a third
// of that) from 3 trainer ranks to 2 or 3 whole engines, forwarded along
// them, with checksums: the small pieces between each pair of ranks travel
// in bundles (one message and one checksum for up to 4 MiB), a bundle whose
// pieces all go on to the next engine goes on whole as a relay (and on
// again with 3), every byte arrives bit-exact, and each rank posts far
// fewer messages than it has transfers (two each without bundles, three
// for a forwarded piece's holder, one per forward). A byte flipped in a
// bundle is caught by the bundle's checksum, naming its sender; one flipped
// by an engine in a relay it forwards, by its holder's hash of that piece.
// (Before relays, an engine's forwards travelled one message each.)
TEST(ReshardExecTest, ManySmallTensorsTravelInBundlesAndRelaysBitExactWithForwardsAndChecksums) {
  // Under a sanitizer half the layers: the same bundles and relays, in a third of CI's time there.
  const int layers = test::kSanitized ? 200 : 400;
  for (int engines : {2, 3}) {
    Job job{"fsdp", 3, engines, 1};
    job.layers = layers;
    job.hidden = 16;
    job.checksums = true;
    auto out = run(job);
    for (size_t r = 0; r < out.size(); ++r) {
      if (r >= 3) {
        auto [got, want] = received_wanted(out[r]);
        EXPECT_EQ(got, want) << out[r];
      }
      const std::string line = "rank " + std::to_string(r) + ": ";
      const uint64_t transfers = figure(out[r], line, ": ");
      const uint64_t messages = figure(out[r], line + std::to_string(transfers) + " transfers", " in ");
      ASSERT_NE(messages, ~0ull) << out[r];
      EXPECT_GT(transfers, static_cast<uint64_t>(layers) * 5 / 2) << out[r];  // 5 tensors a layer
      EXPECT_LT(messages * 20, transfers) << engines << " engines: " << out[r];
    }
    // An engine: every piece it sends is a forward, most in relays. With 3
    // engines the next one may relay the changed bytes on before its own
    // check ends the run, and the last one names the hop it got them from.
    job.forge_rank = 3;
    expect_caught(job, {engines == 2 ? "as rank 3 forwarded them; rank " : " forwarded them; rank ",
                        ", which holds them, sent xxh64 "});
  }
  Job job{"fsdp", 3, 2, 1};
  job.layers = layers;
  job.hidden = 16;
  job.checksums = true;
  job.corrupt_rank = 1;
  expect_caught(job, {"from rank 1", "arrived with xxh64"});
}

// A rank keeps its schedule of a plan (RunOptions::schedule) for the next
// run of the same plan: later versions use it as it is and land bit-exact;
// a run with other options (checksums now on) derives its own.
TEST(ReshardExecTest, ARanksScheduleIsKeptForTheNextRunOfThePlanAndDerivedAgainWhenItsOptionsChange) {
  Job job{"fsdp", 3, 2, 1};
  job.layers = 100;
  job.hidden = 16;
  job.repeats = 3;
  auto out = run(job);
  for (size_t r = 0; r < out.size(); ++r) {
    const std::string rank = "rank " + std::to_string(r) + ": repeat v";
    EXPECT_NE(out[r].find(rank + "2: schedule new"), std::string::npos) << out[r];
    EXPECT_NE(out[r].find(rank + "3: schedule kept"), std::string::npos) << out[r];
    EXPECT_NE(out[r].find(rank + "4: schedule derived again"), std::string::npos) << out[r];
  }
}

// The device path's logic (RunOptions::memory: round by round, each round
// one group of moves, packing and checksums through a DeviceMemory) over
// host memory and Gloo: dim-1 slices packed and unpacked, pieces forwarded
// along the replicas from where they landed, every piece checked.
TEST(ReshardExecTest, RoundByRoundOverAMemoryMegatronToTensorParallelEnginesWithChecksums) {
  Job job{"megatron", 2, 2, 2};
  job.memory = "cpu";
  job.checksums = true;
  auto out = run(job);
  for (size_t r = 2; r < out.size(); ++r) {
    auto [got, want] = received_wanted(out[r]);
    EXPECT_EQ(got, want) << out[r];
  }
}

TEST(ReshardExecTest, RoundByRoundOverAMemoryFsdpAndPipelineSenders) {
  for (const char* layout : {"fsdp", "pipeline"}) {
    Job job{layout, 3, 2, 1};
    job.memory = "cpu";
    auto out = run(job);
    for (size_t r = 3; r < out.size(); ++r) {
      auto [got, want] = received_wanted(out[r]);
      EXPECT_EQ(got, want) << layout << ": " << out[r];
    }
  }
}

// A piece that leaves a trainer rank with one byte flipped (its checksum
// the true one) fails its receiver with DATA_CORRUPT naming the tensor, the
// range and the sender, before the piece counts; no rank ends with wrong
// bytes it did not report, none hangs.
TEST(ReshardExecTest, RoundByRoundAFlippedByteIsCaughtByTheChecksumNamingItsSender) {
  Job job{"megatron", 2, 2, 2};
  job.memory = "cpu";
  job.checksums = true;
  job.corrupt_rank = 1;
  expect_caught(job, {"from rank 1", "arrived with xxh64-blocks"});
}

// An engine that forwards a piece to the next replica changes a byte of it
// and sends a checksum that matches what it sent (a member with a valid
// identity, hostile): the next engine checks the piece against the hash its
// holder (the trainer rank) sent it directly, and fails DATA_CORRUPT naming
// the forwarder and the holder; no rank keeps wrong bytes unreported. Over
// the host path, dense with checksums (a delta plan's forwards take the
// same holder's hash: DeltasPerPiece... runs them). (Before, a forward's
// hash was its forwarder's, and the changed bytes were taken.)
TEST(ReshardExecTest, AForwarderThatChangesAPieceIsCaughtByItsHoldersHash) {
  Job job{"megatron", 2, 2, 2};
  job.checksums = true;
  job.forge_rank = 2;  // an engine rank: every piece it sends is a forward
  expect_caught(job, {"as rank 2 forwarded them; rank ", ", which holds them, sent xxh64 "});
}

// The same round by round (the device path's logic, over a host memory and
// Gloo): the holder's hash comes in one last group after the rounds.
// (Before, a forward's checksum there was its forwarder's, and the changed
// bytes were taken.)
TEST(ReshardExecTest, RoundByRoundAForwarderThatChangesAPieceIsCaughtByItsHoldersHash) {
  Job job{"megatron", 2, 2, 2};
  job.memory = "cpu";
  job.checksums = true;
  job.forge_rank = 2;
  expect_caught(job, {"as rank 2 forwarded them; rank ", ", which holds them, sent "});
}

// The same over NCCL with the buffers on the GPU (tests/gpu/run.sh's
// reshard_nccl stage): ncclSend/ncclRecv in groups, packing by the gather
// kernel, checksums on the device.
TEST(ReshardExecTest, OnNcclMegatronToTensorParallelEnginesWithChecksums) {
  if (test::cuda_devices() == 0) GTEST_SKIP() << "no CUDA device on this machine (GPU tests run in tests/gpu/run.sh)";
  if (const std::string why = backend_unavailable_reason(Backend::kNccl); !why.empty())
    GTEST_SKIP() << "nccl backend cannot run here: " << why;
  for (const char* layout : {"megatron", "fsdp"}) {
    Job job{layout, 2, 2, 2};
    job.memory = "cuda";
    job.checksums = true;
    auto out = run(job);
    for (size_t r = 2; r < out.size(); ++r) {
      auto [got, want] = received_wanted(out[r]);
      EXPECT_EQ(got, want) << layout << ": " << out[r];
    }
  }
}

}  // namespace
}  // namespace paramcast
