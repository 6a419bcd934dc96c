// The JoinGroup message both sides of group formation speak: what the
// publisher announces (rank, world, backend, bootstrap, members, deadlines)
// and the GroupOptions a member builds its communicator from.
#pragma once

#include <string>
#include <vector>

#include "common/config.h"
#include "common/data/communicator.h"
#include "schemas/control.capnp.h"

namespace paramcast::group {

// `members[0]` is the publisher; `options.rank` is the receiver's rank.
void fill_join_group(proto::JoinGroup::Builder b, const GroupOptions& options, const std::vector<std::string>& members);

// The receiving member's GroupOptions; device and Gloo addressing are its own.
GroupOptions group_options_from(proto::JoinGroup::Reader j, uint64_t epoch, Device device,
                                const DataPlaneOptions& data_plane);

}  // namespace paramcast::group
