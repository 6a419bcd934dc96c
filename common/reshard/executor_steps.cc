#include "common/reshard/executor_steps.h"

#include <algorithm>
#include <utility>

#include "common/xxhash.h"

namespace paramcast::reshard::detail {

std::vector<Bundle> plan_bundles(const ReshardPlan& plan, const std::vector<Round>& rounds, int rank) {
  struct Open {
    Bundle bundle;
    size_t place = 0;  // its first transfer's place in the rank's schedule
  };
  std::map<std::pair<int, int>, Open> open;  // by pair (from, to)
  std::vector<Open> done;
  auto close = [&](Open& o) {
    if (o.bundle.transfers.size() > 1) done.push_back(std::move(o));
    o = Open{};
  };
  size_t place = 0;
  for (const Round& round : rounds)
    for (size_t i : round.transfers) {
      const Transfer& x = plan.transfers[i];
      if (x.from != rank && x.to != rank) continue;
      Open& o = open[{x.from, x.to}];
      const bool small = x.after < 0 && x.bytes <= kBundlePieceMax;
      if (!small || o.bundle.bytes + x.bytes > kBundleMax) close(o);
      if (small) {
        if (o.bundle.transfers.empty()) o.place = place;
        o.bundle.transfers.push_back(i);
        o.bundle.bytes += x.bytes;
      }
      ++place;
    }
  for (auto& [pair, o] : open) close(o);
  std::sort(done.begin(), done.end(), [](const Open& a, const Open& b) { return a.place < b.place; });
  std::vector<Bundle> bundles;
  bundles.reserve(done.size());
  for (auto& o : done) bundles.push_back(std::move(o.bundle));
  return bundles;
}

bool unsettled(const std::shared_ptr<Work>& work) {
  return work && (work->wait(Clock::now() + kSettleTimeout).code() == Code::kTimeout || !work->settled());
}

Status RankRun::run() {
  if (Status s = choose(); !s.ok()) return s;
  try {
    if (Status s = send_held(); !s.ok()) return s;
    for (size_t begin = 0, end = 0; begin < batched(); begin = end) {
      end = batch_end(begin);
      if (Status s = post_batch(begin, end); !s.ok()) return s;
      for (size_t i = begin; i < end; ++i)
        if (Status s = receive(i); !s.ok()) return s;
      if (Status s = end_batch(begin, end); !s.ok()) return s;
    }
    if (Status s = check_forwards(); !s.ok()) return s;
    return account();
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  }
}

StatusOr<std::vector<Chosen>> RankRun::choose_transfers(const std::function<Status(const Transfer&)>& admit) const {
  std::vector<Chosen> chosen;
  for (size_t k = 0; k < rounds.size(); ++k)
    for (size_t i : rounds[k].transfers) {
      const Transfer& x = plan.transfers[i];
      if (x.from != rank && x.to != rank) continue;
      auto at = buffer_of(plan, buffers, x, rank);
      if (!at.ok()) return at.status();
      if (admit)
        if (Status s = admit(x); !s.ok()) return s;
      chosen.push_back(Chosen{i, k, *at});
    }
  return chosen;
}

std::vector<size_t> RankRun::hashed_forwards(bool sends, bool takes) const {
  std::vector<size_t> forwards;
  for (const Round& round : rounds)
    for (size_t i : round.transfers) {
      const Transfer& x = plan.transfers[i];
      if (x.after < 0) continue;
      if ((takes && x.to == rank) || (sends && x.to != rank && holder(i) == rank)) forwards.push_back(i);
    }
  return forwards;
}

uint64_t RankRun::holders_hash(size_t forward) const {
  const auto it = held_hashes_.find(chain_start(plan, forward));
  return it == held_hashes_.end() ? 0 : it->second;  // always sent earlier (a forward follows its piece)
}

void RankRun::count_received(uint64_t wire) {
  stats.wire_received += wire;
  if (options.received) *options.received += wire;
}

Status RankRun::about(size_t transfer, Status s) const {
  const Transfer& x = plan.transfers[transfer];
  return s.with_context("many-sender plan: '" + name(x) + "' " + x.region.to_string() + " from rank " +
                        std::to_string(x.from) + " to rank " + std::to_string(x.to));
}

Status RankRun::mismatch(size_t transfer, const std::string& what, const char* hash, uint64_t got, uint64_t want,
                         const char* holder_sent) const {
  const Transfer& x = plan.transfers[transfer];
  const std::string came = std::to_string(x.bytes) + " bytes " + what + " with " + hash + " " + digest_hex(got);
  if (x.after < 0 || !holder_sent) return data_corrupt(came + ", the sender's " + digest_hex(want));
  return data_corrupt(came + " as rank " + std::to_string(x.from) + " forwarded them; rank " +
                      std::to_string(holder(transfer)) + ", which holds them, " + holder_sent + digest_hex(want));
}

}  // namespace paramcast::reshard::detail
