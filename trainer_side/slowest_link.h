// slowest_link(): where a slow update is slow, from each member's inbound
// link rate in the broadcast tree (Gloo's per-link figures). Pure.
//
//  1. The member with the slowest inbound link.
//  2. A member with children posts its receives only a few chunks ahead of
//     its slowest child, so a slow link also slows the link into each of its
//     ancestors: from that member, the culprit is followed down to a child
//     whose link is about as slow (within 25%), as deep as that goes.
//  3. Then its parent's outbound links are compared: when the parent has two
//     or more children and every link out of it is about as slow, the
//     element they share is the parent (its uplink, its NIC), not the child:
//     the parent is named.
#pragma once

#include <map>

namespace paramcast {

struct InboundRate {
  int parent = -1;    // the rank that sends to this one (0: the publisher)
  double rate = 0;    // bytes/s the link sustained while it had work; 0: unknown
};

// `links`: by receiving rank. Returns the rank to name (0: the publisher's own
// links), or -1 without figures.
int slowest_link(const std::map<int, InboundRate>& links);

}  // namespace paramcast
