// attribute(): who broke a group formation, from what every rank saw.
//
// When a Gloo mesh does not connect, each rank that gave up reports the
// ranks it could not reach and those whose address never arrived
// (FormationEvidence, sent in GroupFailed); a rank whose mesh connected says
// GroupReady. A failed pair is one undirected edge: either end may be at
// fault, or the link between them, and a member with a valid identity may
// lie about any pair it is on. A rank is *complete* when its word covers
// every peer (it reported, or was ready): it reached every peer it did not
// name. The verdict:
//   1. rank 0 (the publisher, which runs this) is trusted: every rank it
//      could not reach is at fault;
//   2. a member more of the complete ranks failed with than reached it is at
//      fault (most of those who tried could not reach it), the one with the
//      widest margin first, its edges settled, repeated. A member is never
//      named on less: while fewer than half of the members lie, an honest
//      member (its links to the honest ranks work) has at most the liars
//      against it and every honest rank and the publisher for it, so it is
//      never named (the property tests in tests/common/group/);
//   3. what is left no evidence separates, so nobody is named for it; the
//      next formation leaves some members out, never struck:
//      - accusers: members that each failed only with one member, which two
//        or more of them accuse while more complete ranks reach it (the
//        publisher's own reach counting twice: its working connection
//        outweighs a peer's claim), are the suspects (two members framing a
//        third), and are left out. A lone accuser that named it, while it
//        named nobody, is a suspect too when members not in this formation
//        accused it so recently (`earlier`, counted with the accusers against
//        its reach): framers who speak one formation at a time (one failed
//        for real the first time) are not a tie each;
//      - sides: the members of each group of failed pairs left, split into
//        the two sides that cannot reach each other (a partition); the
//        smaller side is left out, and on a tie the side `turn` picks, so
//        that the sides take turns (formation after formation) and neither
//        is left out for good.
// So a member whose data port is blocked, or that published a bad address,
// is named (every peer failed with it), and the members that tried to reach
// it are not; a member that claims peers are unreachable is named once most
// ranks contradict it.
// Pure: no I/O, no clock, no lock.
#pragma once

#include <cstdint>
#include <map>
#include <set>
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
  std::vector<Blame> blamed;  // at fault, in rank order
  // Step 3: members left out of the next formation, not at fault.
  struct Accusers {
    int accused = -1;
    std::vector<int> accusers;  // left out
    size_t reached_by = 0;      // complete ranks (the publisher among them) that reached it
    size_t earlier = 0;         // other members that accused it so in recent formations
  };
  std::vector<Accusers> accusers;
  struct Sides {
    std::vector<int> kept, left_out;  // the side served next, and the other
  };
  std::vector<Sides> sides;
  std::vector<int> left_out;                    // every member step 3 leaves out, in rank order
  std::vector<std::pair<int, int>> unresolved;  // (a, b), a < b: the failed pairs step 3 weighed
  // (accused, accuser): each member that failed only with one member that
  // more complete ranks reached, and named it in its report, while the
  // accused (not the publisher) did not name it back; the caller keeps these
  // a while, for `earlier` in the formations that follow.
  std::vector<std::pair<int, int>> lone;
};

// `reports`: by rank (0..world-1); entries out of range, or a rank naming
// itself, are ignored. `complete`: the ranks whose word covers every peer
// (empty: every rank that reported); `turn` picks the side on a tie.
// `earlier[v]`: how many members not in this formation accused rank v alone
// in recent formations (Verdict::lone there); a member in it speaks for
// itself now.
Verdict attribute(int world, const std::map<int, RankReport>& reports, const std::set<int>& complete = {},
                  uint64_t turn = 0, const std::map<int, size_t>& earlier = {});

// "unreachable from publisher, worker-1 on its data port; its address never
// reached worker-2", with `names[r]` for rank r.
std::string describe(const Verdict::Blame& blame, const std::vector<std::string>& names);
// What step 3 found and whom the next formation leaves out, one line each.
std::vector<std::string> describe_left_out(const Verdict& v, const std::vector<std::string>& names);

}  // namespace paramcast::group
