// A mixed group (data_plane.local): the members on the publisher's host read
// its shared memory (the shm plane) while the others get the same bytes over
// the backend (Gloo), in the same broadcast. Ranks keep the group's
// numbering outside; inside, each plane numbers its ranks in order with the
// root first (GroupOptions::local says who is where).
//
//  - the root issues every broadcast on both planes and its Work completes
//    when both did; abort() and a failure of either plane end both;
//  - a local member runs only the shm plane, a remote one only the backend;
//  - link_stats() is the backend's, with its peers' ranks given back in the
//    group's numbering (the shm plane has no links to measure).
//
// Thread-safety: as Communicator.
#pragma once

#include <memory>

#include "common/data/communicator.h"

namespace paramcast {

// Creates this rank's side of a mixed group (options.local not empty).
StatusOr<std::unique_ptr<Communicator>> create_split_communicator(const GroupOptions& options, Store& store,
                                                                  FormationEvidence* evidence = nullptr);

}  // namespace paramcast
