#include "common/reshard/reshard_plan.h"

#include <algorithm>
#include <set>

#include "common/xxhash.h"

namespace paramcast::reshard {
namespace {

constexpr size_t kMaxListed = 16;

// Every rank's view of one tensor, and who holds which region of it.
struct TensorFacts {
  TensorSpec spec;
  int first = -1;  // the rank whose spec the others are compared with
  // Distinct regions held, each with its replicas (ascending rank).
  std::map<Region, std::vector<int>> held;
  // The digests replicas gave of a region: the first (rank, digest).
  std::map<Region, std::pair<int, uint64_t>> digest;
};

class Planner {
 public:
  Planner(const std::vector<RankManifest>& ranks, const ReshardOptions& options) : ranks_(ranks), options_(options) {
    for (const auto& r : ranks_) names_[r.rank] = r.name.empty() ? "rank " + std::to_string(r.rank) : r.name;
  }

  StatusOr<ReshardPlan> run() {
    learn_tensors();
    check_regions();
    if (problems_.empty()) check_holdings();
    if (problems_.empty()) check_wants();
    if (!problems_.empty()) return refuse();
    assign();
    if (options_.validate) {
      Status valid = validate_plan(plan_, ranks_);
      if (!valid.ok()) return internal_error("the many-sender plan failed its own check: " + valid.message());
    }
    return std::move(plan_);
  }

 private:
  std::string name(int rank) const {
    auto it = names_.find(rank);
    return it == names_.end() ? "rank " + std::to_string(rank) : it->second;
  }
  std::string names(const std::vector<int>& ranks) const {
    std::string s;
    for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + name(ranks[i]);
    return s;
  }
  // The first kMaxListed are kept, the rest counted (a hostile manifest's
  // mismatches cost no memory).
  void problem(std::string what) {
    if (problems_.size() < kMaxListed) problems_.push_back(std::move(what));
    ++problem_count_;
  }

  StatusOr<ReshardPlan> refuse() const {
    std::string msg = "the many-sender plan has " + std::to_string(problem_count_) + " mismatch" +
                      (problem_count_ == 1 ? "" : "es") + ": ";
    for (size_t i = 0; i < problems_.size(); ++i) msg += (i ? "; " : "") + problems_[i];
    if (problem_count_ > problems_.size()) msg += "; +" + std::to_string(problem_count_ - problems_.size()) + " more";
    return invalid_argument(msg);
  }

  // Each tensor's spec, as every rank that names it states it (once).
  void learn_tensors() {
    std::set<int> seen_ranks;
    for (const auto& r : ranks_) {
      if (!seen_ranks.insert(r.rank).second) problem("rank " + std::to_string(r.rank) + " states its manifest twice");
      auto& stated = stated_[r.rank];
      for (const auto& t : r.tensors) {
        if (!stated.insert(t.name).second) {
          problem("tensor '" + t.name + "': " + name(r.rank) + " states its spec twice");
          continue;
        }
        auto n = t.nbytes();
        if (!n.ok()) {
          problem("tensor '" + t.name + "' at " + name(r.rank) + ": " + n.status().message());
          continue;
        }
        auto [it, fresh] = facts_.try_emplace(t.name);
        if (fresh) {
          it->second.spec = t;
          it->second.first = r.rank;
        } else if (it->second.spec.dtype != t.dtype || it->second.spec.shape != t.shape) {
          problem("tensor '" + t.name + "': " + std::string(dtype_name(it->second.spec.dtype)) + " " +
                  it->second.spec.shape_string() + " at " + name(it->second.first) + ", " +
                  std::string(dtype_name(t.dtype)) + " " + t.shape_string() + " at " + name(r.rank));
        }
      }
    }
  }

  const TensorFacts* facts(const std::string& tensor) const {
    auto it = facts_.find(tensor);
    return it == facts_.end() ? nullptr : &it->second;
  }

  // Every holding and want names a tensor its rank stated, inside it.
  void check_regions() {
    for (const auto& r : ranks_) {
      const auto& names_stated = stated_[r.rank];
      auto check = [&](const Holding& h, const char* verb) {
        const bool stated = names_stated.count(h.tensor) > 0;
        const TensorFacts* f = facts(h.tensor);
        if (!stated || !f) {
          problem(name(r.rank) + " " + verb + " '" + h.tensor + "' without stating its spec");
          return false;
        }
        if (!h.region.inside(f->spec.shape)) {
          problem("tensor '" + h.tensor + "' " + f->spec.shape_string() + ": " + name(r.rank) + " " + verb + " " +
                  h.region.to_string() + ", outside it");
          return false;
        }
        return true;
      };
      for (size_t i = 0; i < r.holds.size(); ++i) {
        const Holding& h = r.holds[i];
        if (!check(h, "holds") || h.region.empty()) continue;
        TensorFacts& f = facts_[h.tensor];
        f.held[h.region].push_back(r.rank);
        auto d = r.digests.find(i);
        if (d == r.digests.end()) continue;
        auto [first, fresh] = f.digest.try_emplace(h.region, r.rank, d->second);
        if (!fresh && first->second.second != d->second)
          problem("tensor '" + h.tensor + "': " + name(first->second.first) + " and " + name(r.rank) + " hold " +
                  h.region.to_string() + " with different bytes (xxh64 " + digest_hex(first->second.second) + " and " +
                  digest_hex(d->second) + "): replicas must hold the same version");
      }
      for (const auto& w : r.wants) check(w, "wants");
    }
    for (auto& [t, f] : facts_)
      for (auto& [region, replicas] : f.held) {
        std::sort(replicas.begin(), replicas.end());
        if (std::adjacent_find(replicas.begin(), replicas.end()) != replicas.end())
          problem("tensor '" + t + "': a rank states holding " + region.to_string() + " twice");
      }
  }

  // Distinct regions held of one tensor never overlap: two ranks that claim
  // the same rows, unless they hold exactly the same region (replicas).
  void check_holdings() {
    for (const auto& [t, f] : facts_)
      for (auto a = f.held.begin(); a != f.held.end(); ++a)
        for (auto b = std::next(a); b != f.held.end(); ++b)
          if (auto common = intersect(a->first, b->first))
            problem("tensor '" + t + "': " + names(a->second) + " hold" + (a->second.size() == 1 ? "s " : " ") +
                    a->first.to_string() + " and " + names(b->second) + " hold" + (b->second.size() == 1 ? "s " : " ") +
                    b->first.to_string() + ": both claim " + common->to_string());
  }

  // A rank's wants of one tensor do not overlap, and someone holds every
  // element of each.
  void check_wants() {
    for (const auto& r : ranks_) {
      std::map<std::string, std::vector<const Region*>> earlier;  // this rank's wants so far, by tensor
      for (const Want& w : r.wants) {
        auto& mine = earlier[w.tensor];
        for (const Region* other : mine)
          if (auto common = intersect(*other, w.region))
            problem("tensor '" + w.tensor + "': " + name(r.rank) + " wants " + other->to_string() + " and " +
                    w.region.to_string() + ", which overlap at " + common->to_string());
        mine.push_back(&w.region);
        std::vector<Region> gaps = {w.region};
        for (const auto& [region, replicas] : facts_[w.tensor].held) {
          std::vector<Region> left;
          for (const auto& g : gaps)
            for (auto& piece : subtract(g, region)) left.push_back(std::move(piece));
          gaps = std::move(left);
        }
        for (size_t g = 0; g < gaps.size() && g < 4; ++g)
          problem("tensor '" + w.tensor + "': " + name(r.rank) + " wants " + gaps[g].to_string() +
                  ", which no rank holds");
      }
    }
  }

  uint32_t tensor_index(const std::string& t) {
    auto it = index_.find(t);
    if (it != index_.end()) return it->second;
    const auto i = static_cast<uint32_t>(plan_.tensors.size());
    plan_.tensors.push_back(facts_[t].spec);
    index_[t] = i;
    return i;
  }

  uint64_t bytes_of(const std::string& t, const Region& r) const {
    return r.elements() * dtype_size(facts_.at(t).spec.dtype);
  }

  void add(int from, int to, uint32_t t, const Region& r, uint64_t bytes, int after) {
    plan_.transfers.push_back(Transfer{from, to, t, r, bytes, after});
    plan_.sent[from] += bytes;
    plan_.received[to] += bytes;
  }

  // Each wanted piece (a want ∩ a held region) from the replica that has
  // sent least so far; the ranks that want the same piece in a chain.
  void assign() {
    // (tensor, piece) -> the ranks that want it, and the held region it lies in.
    struct Demand {
      std::vector<int> wanted_by;
      const Region* held = nullptr;
    };
    std::map<std::pair<std::string, Region>, Demand> demands;
    // The lower bound on the busiest link: what each rank must receive, and
    // what must leave each set of replicas (a region's holders) between them.
    std::map<int, uint64_t> must_receive;
    std::map<std::vector<int>, uint64_t> must_leave;
    for (const auto& r : ranks_)
      for (const auto& w : r.wants)
        for (const auto& [region, replicas] : facts_[w.tensor].held)
          if (auto piece = intersect(w.region, region)) {
            auto& d = demands[{w.tensor, *piece}];
            d.wanted_by.push_back(r.rank);
            d.held = &region;
          }
    size_t chain = 0;
    for (auto& [key, d] : demands) {
      const auto& [t, piece] = key;
      const auto& replicas = facts_[t].held.at(*d.held);
      const uint64_t bytes = bytes_of(t, piece);
      // A rank that holds the piece itself needs nothing sent.
      std::erase_if(d.wanted_by, [&](int r) { return std::binary_search(replicas.begin(), replicas.end(), r); });
      if (d.wanted_by.empty()) continue;
      must_leave[replicas] += bytes;
      for (int r : d.wanted_by) must_receive[r] += bytes;
      const int sender = *std::min_element(replicas.begin(), replicas.end(), [&](int a, int b) {
        return plan_.sent[a] != plan_.sent[b] ? plan_.sent[a] < plan_.sent[b] : a < b;
      });
      const uint32_t ti = tensor_index(t);
      if (!options_.forward) {
        for (int r : d.wanted_by) add(sender, r, ti, piece, bytes, -1);
        continue;
      }
      // Rotated from chain to chain: each rank is last (forwards nothing)
      // in its share of the chains.
      std::rotate(d.wanted_by.begin(), d.wanted_by.begin() + static_cast<long>(chain++ % d.wanted_by.size()),
                  d.wanted_by.end());
      int from = sender, after = -1;
      for (int r : d.wanted_by) {
        add(from, r, ti, piece, bytes, after);
        after = static_cast<int>(plan_.transfers.size()) - 1;
        from = r;
      }
    }
    uint64_t& least = plan_.least_busiest_bytes;
    for (const auto& [r, b] : must_receive) least = std::max(least, b);
    // Bytes only one rank holds leave that rank; a set of replicas sends
    // what only its members hold between them, at least its share each.
    std::map<int, uint64_t> sole;
    for (const auto& [holders, b] : must_leave)
      if (holders.size() == 1) sole[holders[0]] += b;
    for (const auto& [r, b] : sole) least = std::max(least, b);
    for (const auto& [holders, b] : must_leave) {
      if (holders.size() < 2) continue;
      uint64_t total = b;
      for (int h : holders) total += sole.count(h) ? sole[h] : 0;
      least = std::max(least, total / holders.size());
    }
  }

  const std::vector<RankManifest>& ranks_;
  const ReshardOptions options_;
  std::map<int, std::string> names_;
  std::map<std::string, TensorFacts> facts_;
  std::map<int, std::set<std::string>> stated_;  // the tensor names each rank stated
  std::map<std::string, uint32_t> index_;
  std::vector<std::string> problems_;
  size_t problem_count_ = 0;
  ReshardPlan plan_;
};

}  // namespace

uint64_t ReshardPlan::busiest_bytes() const {
  uint64_t most = 0;
  for (const auto& [r, b] : sent) most = std::max(most, b);
  for (const auto& [r, b] : received) most = std::max(most, b);
  return most;
}

size_t chain_start(const ReshardPlan& plan, size_t transfer) {
  size_t i = transfer;
  while (i < plan.transfers.size() && plan.transfers[i].after >= 0 && static_cast<size_t>(plan.transfers[i].after) < i)
    i = static_cast<size_t>(plan.transfers[i].after);
  return i;
}

StatusOr<ReshardPlan> plan_reshard(const std::vector<RankManifest>& ranks, const ReshardOptions& options) {
  return Planner(ranks, options).run();
}

Status validate_plan(const ReshardPlan& plan, const std::vector<RankManifest>& ranks) {
  std::map<int, const RankManifest*> by_rank;
  for (const auto& r : ranks) by_rank[r.rank] = &r;
  // Each rank's holdings and wants, by tensor: every lookup below is one
  // tensor's few regions, never a scan of the manifest.
  using Key = std::pair<int, std::string>;
  std::map<Key, std::vector<const Region*>> holds, wants;
  for (const auto& r : ranks) {
    for (const auto& h : r.holds) holds[{r.rank, h.tensor}].push_back(&h.region);
    for (const auto& w : r.wants) wants[{r.rank, w.tensor}].push_back(&w.region);
  }
  auto of = [](const std::map<Key, std::vector<const Region*>>& m, int rank,
               const std::string& t) -> const std::vector<const Region*>& {
    static const std::vector<const Region*> kNone;
    auto it = m.find({rank, t});
    return it == m.end() ? kNone : it->second;
  };
  std::vector<std::string> bad;
  // What arrives at each rank, per tensor name.
  std::map<std::pair<int, std::string>, std::vector<Region>> arrived;
  for (size_t i = 0; i < plan.transfers.size(); ++i) {
    const Transfer& x = plan.transfers[i];
    const std::string what = "transfer #" + std::to_string(i);
    if (x.tensor >= plan.tensors.size() || !by_rank.count(x.from) || !by_rank.count(x.to) || x.from == x.to) {
      bad.push_back(what + " names no tensor, an unknown rank, or the same rank twice");
      continue;
    }
    const TensorSpec& t = plan.tensors[x.tensor];
    if (!x.region.inside(t.shape) || x.region.empty() || x.bytes != x.region.elements() * dtype_size(t.dtype)) {
      bad.push_back(what + " of '" + t.name + "' " + x.region.to_string() + " is outside it or miscounted");
      continue;
    }
    // Its source holds the region, or got it from the transfer it follows.
    bool has = false;
    if (x.after >= 0) {
      const auto a = static_cast<size_t>(x.after);
      has = a < i && plan.transfers[a].to == x.from && plan.transfers[a].tensor == x.tensor &&
            plan.transfers[a].region == x.region;
    } else {
      for (const Region* h : of(holds, x.from, t.name))
        if (contains(*h, x.region)) has = true;
    }
    if (!has) bad.push_back(what + ": rank " + std::to_string(x.from) + " does not have '" + t.name + "' " +
                            x.region.to_string() + " to send");
    arrived[{x.to, t.name}].push_back(x.region);
  }
  // Every wanted element exactly once (held ones need nothing).
  for (const auto& r : ranks)
    for (const auto& w : r.wants) {
      auto& got = arrived[{r.rank, w.tensor}];
      uint64_t inside = 0;
      for (const auto& g : got)
        if (auto c = intersect(g, w.region)) inside += c->elements();
      uint64_t held = 0;
      for (const Region* h : of(holds, r.rank, w.tensor))
        if (auto c = intersect(*h, w.region)) held += c->elements();
      if (inside + held != w.region.elements())
        bad.push_back("rank " + std::to_string(r.rank) + " gets " + std::to_string(inside + held) + " of the " +
                      std::to_string(w.region.elements()) + " elements of '" + w.tensor + "' " +
                      w.region.to_string() + " it wants");
    }
  for (const auto& [key, got] : arrived) {
    for (size_t i = 0; i < got.size(); ++i)
      for (size_t j = i + 1; j < got.size(); ++j)
        if (auto c = intersect(got[i], got[j]))
          bad.push_back("rank " + std::to_string(key.first) + " gets '" + key.second + "' " + c->to_string() +
                        " twice");
    for (const auto& g : got) {
      uint64_t wanted = 0;
      for (const Region* w : of(wants, key.first, key.second))
        if (auto c = intersect(g, *w)) wanted += c->elements();
      if (wanted != g.elements())
        bad.push_back("rank " + std::to_string(key.first) + " gets '" + key.second + "' " + g.to_string() +
                      ", which it does not want");
    }
  }
  if (bad.empty()) return Status();
  std::string msg = std::to_string(bad.size()) + " problems: ";
  for (size_t i = 0; i < bad.size() && i < kMaxListed; ++i) msg += (i ? "; " : "") + bad[i];
  return invalid_argument(msg);
}

}  // namespace paramcast::reshard
