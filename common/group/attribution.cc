#include "common/group/attribution.h"

#include <algorithm>
#include <set>

namespace paramcast::group {

namespace {

// One failed pair and who said so (a < b).
struct Edge {
  int a, b;
  bool operator<(const Edge& o) const { return std::tie(a, b) < std::tie(o.a, o.b); }
};

struct Claim {
  int reporter, about;
  bool no_address;
};

}  // namespace

Verdict attribute(int world, const std::map<int, RankReport>& reports) {
  std::vector<Claim> claims;
  std::set<Edge> edges;
  auto add = [&](int reporter, int about, bool no_address) {
    if (reporter < 0 || reporter >= world || about < 0 || about >= world || about == reporter) return;
    claims.push_back({reporter, about, no_address});
    edges.insert({std::min(reporter, about), std::max(reporter, about)});
  };
  for (const auto& [rank, report] : reports) {
    for (int r : report.unreachable) add(rank, r, false);
    for (int r : report.no_address) add(rank, r, true);
  }

  std::set<int> at_fault;
  auto settle = [&](int v) {
    at_fault.insert(v);
    for (auto it = edges.begin(); it != edges.end();) it = (it->a == v || it->b == v) ? edges.erase(it) : std::next(it);
  };
  // 1. The publisher's own evidence.
  for (const auto& c : claims)
    if (c.reporter == 0 && !at_fault.count(c.about)) settle(c.about);
  // 2. Ranks that failed with two or more distinct peers, most edges first.
  for (;;) {
    std::map<int, int> degree;
    for (const auto& e : edges) {
      ++degree[e.a];
      ++degree[e.b];
    }
    int best = -1, most = 1;
    for (const auto& [v, d] : degree)
      if (v != 0 && d > most) {
        best = v;
        most = d;
      }
    if (best < 0) break;
    settle(best);
  }

  Verdict verdict;
  for (int v : at_fault) {
    Verdict::Blame b;
    b.rank = v;
    auto corroborated = [&](int peer) {  // the peer said the same of v
      return std::any_of(claims.begin(), claims.end(), [&](const Claim& o) { return o.reporter == peer && o.about == v; });
    };
    for (const auto& c : claims) {
      if (c.about == v && !at_fault.count(c.reporter)) (c.no_address ? b.address_missed_by : b.unreachable_from).push_back(c.reporter);
      if (c.reporter == v && !at_fault.count(c.about) && !corroborated(c.about)) b.claims_unreachable.push_back(c.about);
    }
    for (auto* list : {&b.unreachable_from, &b.address_missed_by, &b.claims_unreachable}) {
      std::sort(list->begin(), list->end());
      list->erase(std::unique(list->begin(), list->end()), list->end());
    }
    verdict.blamed.push_back(std::move(b));
  }
  for (const auto& e : edges) verdict.unresolved.emplace_back(e.a, e.b);
  return verdict;
}

std::string describe(const Verdict::Blame& blame, const std::vector<std::string>& names) {
  auto list = [&](const std::vector<int>& ranks) {
    std::string out;
    for (int r : ranks)
      out += (out.empty() ? "" : ", ") +
             (r < static_cast<int>(names.size()) && !names[r].empty() ? names[r] : "rank " + std::to_string(r));
    return out;
  };
  std::string out;
  if (!blame.unreachable_from.empty()) out = "unreachable from " + list(blame.unreachable_from) + " on its data port";
  if (!blame.address_missed_by.empty())
    out += (out.empty() ? "" : "; ") + std::string("its rendezvous address never reached ") + list(blame.address_missed_by);
  if (!blame.claims_unreachable.empty())
    out += (out.empty() ? "" : "; ") + std::string("it could not reach ") + list(blame.claims_unreachable);
  return out;
}

}  // namespace paramcast::group
