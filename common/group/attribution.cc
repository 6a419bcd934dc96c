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

// One attribution, step by step (attribution.h): the claims and failed
// pairs, the ranks found at fault, and what the verdict holds so far.
class Attribution {
 public:
  Attribution(int world, const std::map<int, RankReport>& reports, const std::set<int>& complete_in);
  // 1. The publisher's own evidence.
  void trust_publisher();
  // 2. A member more complete ranks failed with than reached, widest margin first.
  void settle_widest_margins();
  // The ranks at fault, each with its evidence; the failed pairs left.
  void blame();
  // 3. Nobody is named for what is left: the accusers, then the sides.
  void leave_out_accusers(const std::map<int, size_t>& earlier);
  void leave_out_sides(uint64_t turn);
  Verdict take() {
    verdict_.left_out.assign(left_.begin(), left_.end());
    return std::move(verdict_);
  }

 private:
  void settle(int v);
  void drop_edges_of(int v);
  size_t reached_by(int v) const;
  std::set<int> accusers_of(int v) const;
  bool said(int reporter, int about) const;
  // A group of failed pairs split into the side kept and the side left out.
  Verdict::Sides split_two_sides(const std::vector<int>& component, std::map<int, int>& color, uint64_t turn) const;
  Verdict::Sides split_most_failed(const std::vector<int>& component, std::map<int, std::set<int>>& adj,
                                   uint64_t turn) const;

  std::vector<Claim> claims_;
  std::set<Edge> edges_;   // the failed pairs not settled yet
  std::set<Edge> failed_;  // every pair anyone said failed
  std::set<int> complete_;
  std::set<int> at_fault_;
  std::set<int> left_;  // left out by step 3
  Verdict verdict_;
};

Attribution::Attribution(int world, const std::map<int, RankReport>& reports, const std::set<int>& complete_in) {
  auto add = [&](int reporter, int about, bool no_address) {
    if (reporter < 0 || reporter >= world || about < 0 || about >= world || about == reporter) return;
    claims_.push_back({reporter, about, no_address});
    edges_.insert({std::min(reporter, about), std::max(reporter, about)});
  };
  for (const auto& [rank, report] : reports) {
    for (int r : report.unreachable) add(rank, r, false);
    for (int r : report.no_address) add(rank, r, true);
  }
  failed_ = edges_;
  for (int c : complete_in)
    if (c >= 0 && c < world) complete_.insert(c);
  if (complete_in.empty())
    for (const auto& [rank, report] : reports)
      if (rank >= 0 && rank < world) complete_.insert(rank);
}

void Attribution::drop_edges_of(int v) {
  for (auto it = edges_.begin(); it != edges_.end();) it = (it->a == v || it->b == v) ? edges_.erase(it) : std::next(it);
}

void Attribution::settle(int v) {
  at_fault_.insert(v);
  drop_edges_of(v);
}

// The complete ranks (not at fault) that reached v: no failed pair with it.
size_t Attribution::reached_by(int v) const {
  size_t n = 0;
  for (int c : complete_)
    if (c != v && !at_fault_.count(c) && !failed_.count({std::min(c, v), std::max(c, v)})) ++n;
  return n;
}

std::set<int> Attribution::accusers_of(int v) const {
  std::set<int> out;
  for (const auto& e : edges_) {
    if (e.a == v) out.insert(e.b);
    if (e.b == v) out.insert(e.a);
  }
  return out;
}

// `reporter`'s own report named `about`.
bool Attribution::said(int reporter, int about) const {
  return std::any_of(claims_.begin(), claims_.end(),
                     [&](const Claim& c) { return c.reporter == reporter && c.about == about; });
}

void Attribution::trust_publisher() {
  for (const auto& c : claims_)
    if (c.reporter == 0 && !at_fault_.count(c.about)) settle(c.about);
}

void Attribution::settle_widest_margins() {
  for (;;) {
    std::set<int> on_edges;
    for (const auto& e : edges_) on_edges.insert({e.a, e.b});
    int best = -1;
    long margin = 0;
    for (int v : on_edges) {
      if (v == 0) continue;
      const long m = static_cast<long>(accusers_of(v).size()) - static_cast<long>(reached_by(v));
      if (m > margin) {
        best = v;
        margin = m;
      }
    }
    if (best < 0) break;
    settle(best);
  }
}

void Attribution::blame() {
  for (int v : at_fault_) {
    Verdict::Blame b;
    b.rank = v;
    auto corroborated = [&](int peer) { return said(peer, v); };  // the peer said the same of v
    for (const auto& c : claims_) {
      if (c.about == v && !at_fault_.count(c.reporter)) (c.no_address ? b.address_missed_by : b.unreachable_from).push_back(c.reporter);
      if (c.reporter == v && !at_fault_.count(c.about) && !corroborated(c.about)) b.claims_unreachable.push_back(c.about);
    }
    for (auto* list : {&b.unreachable_from, &b.address_missed_by, &b.claims_unreachable}) {
      std::sort(list->begin(), list->end());
      list->erase(std::unique(list->begin(), list->end()), list->end());
    }
    verdict_.blamed.push_back(std::move(b));
  }
  for (const auto& e : edges_) verdict_.unresolved.emplace_back(e.a, e.b);
}

// Accusers first: members whose only failed pair is with one member that two
// or more of them (with those that accused it so in recent formations)
// accuse while more complete ranks reach it.
void Attribution::leave_out_accusers(const std::map<int, size_t>& earlier) {
  auto degree = [&](int v) { return accusers_of(v).size(); };
  std::map<int, std::set<int>> lone;  // accused -> its accusers that failed with nobody else
  for (const auto& e : edges_) {
    if (degree(e.a) == 1 && e.a != 0) lone[e.b].insert(e.a);  // the publisher is never left out
    if (degree(e.b) == 1 && e.b != 0) lone[e.a].insert(e.b);
  }
  for (const auto& [v, who] : lone) {
    const size_t reached = reached_by(v);
    // The publisher's own connection to v outweighs a peer's claim: it
    // counts twice here (it is trusted, and its link to v worked).
    const size_t reach = reached + (complete_.count(0) && !at_fault_.count(0) && !failed_.count({0, v}) ? 1 : 0);
    if (accusers_of(v).size() >= reach) continue;
    // Accusations proper: a named v, and v (complete) did not name a.
    std::set<int> accused_it;
    for (int a : who)
      if (said(a, v) && !said(v, a)) accused_it.insert(a);
    if (v != 0)
      for (int a : accused_it) verdict_.lone.emplace_back(v, a);
    if (left_.count(v)) continue;
    // The accusers who spoke: a member whose only failed pair came from
    // v's own claim about it (it was ready; it said nothing) is no suspect.
    std::set<int> spoke;
    for (int a : who)
      if (said(a, v)) spoke.insert(a);
    if (spoke.size() >= 2) {  // two or more in this formation
      verdict_.accusers.push_back({v, std::vector<int>(spoke.begin(), spoke.end()), reached, 0});
      left_.insert(spoke.begin(), spoke.end());
      continue;
    }
    // One in this formation: with the members not in it that accused v
    // so recently, while more ranks still reach v than accuse it.
    auto e = earlier.find(v);
    const size_t before = e == earlier.end() ? 0 : e->second;
    if (accused_it.empty() || accused_it.size() + before < 2 || accusers_of(v).size() + before >= reach) continue;
    verdict_.accusers.push_back({v, std::vector<int>(accused_it.begin(), accused_it.end()), reached, before});
    left_.insert(accused_it.begin(), accused_it.end());
  }
  for (int v : left_) drop_edges_of(v);
}

// Then the sides of each group of failed pairs left.
void Attribution::leave_out_sides(uint64_t turn) {
  std::map<int, std::set<int>> adj;
  for (const auto& e : edges_) {
    adj[e.a].insert(e.b);
    adj[e.b].insert(e.a);
  }
  std::set<int> seen;
  for (const auto& [start, ignored] : adj) {
    if (seen.count(start)) continue;
    std::map<int, int> color{{start, 0}};
    std::vector<int> todo{start}, component;
    bool bipartite = true;
    while (!todo.empty()) {
      const int v = todo.back();
      todo.pop_back();
      if (!seen.insert(v).second) continue;
      component.push_back(v);
      for (int w : adj[v]) {
        if (!color.count(w)) {
          color[w] = 1 - color[v];
          todo.push_back(w);
        } else if (color[w] == color[v]) {
          bipartite = false;
        }
      }
    }
    std::sort(component.begin(), component.end());
    Verdict::Sides sides =
        bipartite ? split_two_sides(component, color, turn) : split_most_failed(component, adj, turn);
    left_.insert(sides.left_out.begin(), sides.left_out.end());
    verdict_.sides.push_back(std::move(sides));
  }
}

// Two sides: the smaller is left out, on a tie the one `turn` picks.
Verdict::Sides Attribution::split_two_sides(const std::vector<int>& component, std::map<int, int>& color,
                                            uint64_t turn) const {
  Verdict::Sides sides;
  std::vector<int> side[2];  // side[0] holds the component's lowest rank
  for (int v : component) side[color[v] == color[component.front()] ? 0 : 1].push_back(v);
  // The publisher's side is always served (side[0] holds rank 0 when it
  // is in this component: it is the lowest rank).
  const int out = component.front() == 0                 ? 1
                  : side[0].size() != side[1].size() ? (side[0].size() < side[1].size() ? 0 : 1)
                                                     : static_cast<int>((turn + 1) % 2);
  sides.left_out = side[out];
  sides.kept = side[1 - out];
  return sides;
}

// Not two sides: members out, most failed pairs first (ties by turn: the
// lowest rank first, then the highest), until none is left.
Verdict::Sides Attribution::split_most_failed(const std::vector<int>& component, std::map<int, std::set<int>>& adj,
                                              uint64_t turn) const {
  Verdict::Sides sides;
  std::map<int, std::set<int>> rest;
  for (int v : component) rest[v] = adj[v];
  for (;;) {
    int pick = -1;
    size_t most = 0;
    for (const auto& [v, peers] : rest) {
      if (v == 0) continue;  // the publisher stays
      const bool better = peers.size() > most || (peers.size() == most && most > 0 && turn % 2 == 1);
      if (better) {
        pick = v;
        most = peers.size();
      }
    }
    if (pick < 0) break;
    sides.left_out.push_back(pick);
    for (int w : rest[pick]) rest[w].erase(pick);
    rest[pick].clear();
  }
  for (int v : component)
    if (std::find(sides.left_out.begin(), sides.left_out.end(), v) == sides.left_out.end()) sides.kept.push_back(v);
  std::sort(sides.left_out.begin(), sides.left_out.end());
  return sides;
}

}  // namespace

Verdict attribute(int world, const std::map<int, RankReport>& reports, const std::set<int>& complete_in,
                  uint64_t turn, const std::map<int, size_t>& earlier) {
  Attribution a(world, reports, complete_in);
  a.trust_publisher();        // 1.
  a.settle_widest_margins();  // 2.
  a.blame();
  a.leave_out_accusers(earlier);  // 3.
  a.leave_out_sides(turn);
  return a.take();
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

std::vector<std::string> describe_left_out(const Verdict& v, const std::vector<std::string>& names) {
  auto name = [&](int r) {
    return r < static_cast<int>(names.size()) && !names[static_cast<size_t>(r)].empty() ? names[static_cast<size_t>(r)]
                                                                                          : "rank " + std::to_string(r);
  };
  auto list = [&](const std::vector<int>& ranks) {
    std::string out;
    for (int r : ranks) out += (out.empty() ? "" : ", ") + name(r);
    return out;
  };
  std::vector<std::string> out;
  for (const auto& a : v.accusers) {
    const bool one = a.accusers.size() == 1;
    std::string line = list(a.accusers);
    line += one ? " said it could not reach " : " said they could not reach ";
    line += name(a.accused);
    if (a.earlier > 0) {
      line += " (as ";
      line += std::to_string(a.earlier);
      line += a.earlier == 1 ? " other member did" : " other members did";
      line += " in a recent formation)";
    }
    line += ", which ";
    line += std::to_string(a.reached_by);
    line += one ? " ranks reached: it is the suspect, left out of the next formation (not struck)"
                : " ranks reached: they are the suspects, left out of the next formation (not struck)";
    out.push_back(std::move(line));
  }
  for (const auto& s : v.sides) {
    std::string line = "{";
    line += list(s.kept);
    line += "} and {";
    line += list(s.left_out);
    line += "} cannot reach each other on the data plane (either side may be at fault): the next formation "
            "leaves out {";
    line += list(s.left_out);
    line += "} (not struck; on a tie the sides take turns)";
    out.push_back(std::move(line));
  }
  return out;
}

}  // namespace paramcast::group
