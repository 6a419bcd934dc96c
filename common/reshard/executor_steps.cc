#include "common/reshard/executor_steps.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "common/xxhash.h"

namespace paramcast::reshard::detail {

namespace {

// Every pair's held bundles (plan_bundles' first half), in schedule order of
// their first pieces.
std::vector<Bundle> held_bundles(const ReshardPlan& plan, const std::vector<Round>& rounds) {
  struct Open {
    Bundle bundle;
    size_t place = 0;  // its first transfer's place in the schedule
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

// The relays of `bundles` (appended to it): a bundle whose every piece has
// exactly one forward, all to the same rank, is forwarded as one message.
void add_relays(const ReshardPlan& plan, std::vector<Bundle>& bundles) {
  constexpr size_t kNone = SIZE_MAX, kMany = SIZE_MAX - 1;
  std::vector<size_t> forward(plan.transfers.size(), kNone);  // a transfer's only forward
  for (size_t i = 0; i < plan.transfers.size(); ++i)
    if (const int after = plan.transfers[i].after; after >= 0) {
      size_t& f = forward[static_cast<size_t>(after)];
      f = f == kNone ? i : kMany;
    }
  for (size_t b = 0; b < bundles.size(); ++b) {  // grows: a relay may be relayed on
    Bundle relay{{}, bundles[b].bytes, true, static_cast<long>(b)};
    for (size_t i : bundles[b].transfers) {
      const size_t f = forward[i];  // the same piece, on along its chain
      if (f >= kMany || plan.transfers[f].region != plan.transfers[i].region ||
          plan.transfers[f].to != plan.transfers[forward[bundles[b].transfers.front()]].to)
        break;
      relay.transfers.push_back(f);
    }
    if (relay.transfers.size() == bundles[b].transfers.size()) bundles.push_back(std::move(relay));
  }
}

}  // namespace

std::vector<Bundle> plan_bundles(const ReshardPlan& plan, const std::vector<Round>& rounds, int rank) {
  std::vector<Bundle> all = held_bundles(plan, rounds);
  add_relays(plan, all);
  // This rank's, a relay's source index renumbered among them (-1 when the
  // source is another pair's).
  std::vector<long> kept(all.size(), -1);
  std::vector<Bundle> mine;
  for (size_t b = 0; b < all.size(); ++b) {
    const Transfer& x = plan.transfers[all[b].transfers.front()];
    if (x.from != rank && x.to != rank) continue;
    kept[b] = static_cast<long>(mine.size());
    Bundle& m = mine.emplace_back(std::move(all[b]));
    if (m.source >= 0) m.source = kept[static_cast<size_t>(m.source)];
  }
  return mine;
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
      auto at = buffer_of(plan, buffers, x, rank, found_);
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
