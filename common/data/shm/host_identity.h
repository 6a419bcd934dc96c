// Which processes can share memory with this one: the host's boot id, the
// user id and the network namespace, "<boot id>:<uid>:net:[<inode>]".
// Members compare it in Hello (data_plane.local): never guessed from an
// address. A member in another network namespace (a container, a test's
// netns) counts as another host: its traffic goes over the backend.
#pragma once

#include <string>

namespace paramcast::shm_backend {

// Empty when the host does not say (no /proc): then nobody is local.
std::string host_identity();

}  // namespace paramcast::shm_backend
