// attribute(): who broke a group formation, from what every rank saw.
//
// When a Gloo mesh does not connect, each rank that gave up reports the
// ranks it could not reach and those whose address never arrived
// (FormationEvidence, sent in GroupFailed). A failed pair is one undirected
// edge: either end may be at fault. The verdict:
//   1. rank 0 (the publisher, which runs this) is trusted: every rank it
//      could not reach is at fault;
//   2. of the edges left, the rank on the most of them, if at least two
//      distinct peers failed with it, is at fault, and its edges are settled;
//      repeated (ties: the lowest rank) until no rank has two;
//   3. the edges left (two members that failed only with each other) are
//      unresolved: named as evidence, nobody is blamed for them.
// So a member whose data port is blocked, or that published a bad address,
// is named (every peer failed with it), and the members that tried to reach
// it are not; a member that claims peers are unreachable is itself on every
// edge it claims and is named once it claims two.
// Pure: no I/O, no clock, no lock.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace paramcast::group {

struct RankReport {
  std::vector<int> unreachable;
  std::vector<int> no_address;
};

struct Verdict {
  struct Blame {
    int rank = -1;
    std::vector<int> unreachable_from;    // the peers that could not connect to it
    std::vector<int> address_missed_by;   // the peers its address never reached
    std::vector<int> claims_unreachable;  // the peers it alone said it could not reach
  };
  std::vector<Blame> blamed;                   // in rank order
  std::vector<std::pair<int, int>> unresolved;  // (a, b), a < b: failed only with each other
};

// `reports`: by rank (0..world-1); entries out of range, or a rank naming
// itself, are ignored.
Verdict attribute(int world, const std::map<int, RankReport>& reports);

// "unreachable from publisher, worker-1 on its data port; its address never
// reached worker-2", with `names[r]` for rank r.
std::string describe(const Verdict::Blame& blame, const std::vector<std::string>& names);

}  // namespace paramcast::group
