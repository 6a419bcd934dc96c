// schedule_rounds(): the order a many-sender plan's transfers run in.
//
// Each rank has one link each way (../shared LINK_LIMIT.md), so the
// transfers are put in rounds in which no rank sends more than one and none
// receives more than one (no incast onto an engine, no sender splitting its
// link), and a forward runs in a later round than the transfer that brings
// it its bytes. Greedy list scheduling: transfers by their place in their
// chain, then largest first, each in the earliest round where both ends are
// free. A round lasts as long as its largest transfer; the sum over rounds
// is the plan's time on equal links, in bytes, to set against
// ReshardPlan::least_busiest_bytes.
// Pure: no I/O, no clock, no lock.
#pragma once

#include <cstdint>
#include <vector>

#include "common/reshard/reshard_plan.h"

namespace paramcast::reshard {

struct Round {
  std::vector<size_t> transfers;  // indices into ReshardPlan::transfers
  uint64_t longest = 0;           // bytes of its largest transfer
};

std::vector<Round> schedule_rounds(const ReshardPlan& plan);
// Sum of the rounds' longest transfers: the plan's time at one byte per unit.
uint64_t schedule_bytes(const std::vector<Round>& rounds);

}  // namespace paramcast::reshard
