// Communicator: the data plane's one interface. It moves tensor bytes between
// the ranks of a group that the control plane formed; it never decides who is
// in the group or what the bytes mean.
//
// A communicator is created from a GroupOptions (what JoinGroup carries) and a
// Store for the backend's rendezvous. Broadcast is bitwise and asynchronous:
// it returns a Work that completes in issue order and is waited on with a
// deadline. After any failure, or abort(), the communicator is unusable: every
// pending and later operation fails fast with kAborted, and the group must be
// re-formed (a new epoch, a new communicator).
//
// Slow is not dead. A backend fails a broadcast for slowness only when a link
// it feeds makes no progress for `stall_timeout` (kTimeout, naming the link);
// a slow link that keeps moving bytes never fails it. Dead peers are the
// control plane's to name (heartbeats); `op_timeout` is only a backstop, and
// the caller bounds the whole update with the deadline it waits with.
//
// Backends: data/gloo (host memory over TCP), data/nccl (CUDA memory),
// data/shm (host memory shared by the ranks of one host).
//
// Point to point (send/recv) for many-sender updates: Gloo and shm in host
// memory, matched by tag; NCCL by issue order, the moves between
// begin_moves() and end_moves() one NCCL group.
// point_to_point_unavailable_reason() is the one rule of which planes a
// many-sender update runs on.
//
// The room's other files: device_memory.h (staging, copies and checksums per
// device, so the pipeline is written once for host and CUDA memory),
// block_pool.h (staging reused, not reallocated), bucket_checksum.h (xxh64
// and xxh64-blocks, one definition for host and device), store.h and
// file_store (rendezvous; the file store for tools without a publisher),
// factory.cc (create_communicator, mint_bootstrap), split_communicator.h
// (data_plane.local: auto: the publisher's host on shm, the others on Gloo,
// one broadcast on both; GroupHost::choose_local decides), reaper.h
// (communicators released on a thread of their own, so no control thread or
// caller waits on a teardown). Only each backend's factory header
// (gloo_factory.h, shm_factory.h, nccl_factory.h) is visible outside it.
//
// Thread-safety: broadcast() from one thread at a time; abort() and
// async_error() from any thread.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/data/store.h"
#include "common/status.h"
#include "common/tensor.h"

namespace paramcast {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

struct GroupOptions {
  uint64_t epoch = 0;
  int rank = 0;
  int world_size = 1;
  Backend backend = Backend::kGloo;
  // ncclUniqueId bytes (NCCL) or the rendezvous key prefix (Gloo).
  std::string bootstrap;
  Device device;
  std::chrono::milliseconds init_timeout{60000};
  // Backstop on one broadcast, whatever its progress (the publisher passes
  // its update_timeout: no broadcast outlives the update it belongs to).
  std::chrono::milliseconds op_timeout{600000};
  // A broadcast fails with kTimeout when a link this rank sends on makes no
  // progress for this long (data_plane.stall_timeout).
  std::chrono::milliseconds stall_timeout{30000};
  // publisher.on_slow_member: shed (Gloo): a child at a leaf of the tree whose
  // link sustained less than shed_floor bytes/s over shed_window of busy time
  // is shed (LinkStats::shed) and the broadcast goes on without it; 0: never.
  uint64_t shed_floor = 0;
  std::chrono::milliseconds shed_window{5000};
  // Name of each rank (index = rank: "publisher", then worker ids), for
  // messages; may be empty.
  std::vector<std::string> members;
  std::string gloo_hostname = "127.0.0.1";
  // Mixed groups (data_plane.local): per rank, whether it reads the root's
  // shared memory; empty: none does. The backend then carries rank 0 and
  // the other ranks (renumbered in order), the shm plane rank 0 and these.
  std::vector<bool> local;
  std::string local_bootstrap;  // the shm plane's, when any rank is local
  // shm root: each reader's own secret by its rank on the shm plane (what
  // its JoinGroup carried, index 0 unused); a reader must present its own,
  // so no holder of a secret attaches as another rank. Empty: every reader
  // presents the bootstrap's secret (tools that share one bootstrap).
  std::vector<std::string> shm_rank_secrets;
  // shm: bytes of each of the ring's two slots (the root's choice: the data
  // plane's bucket size; readers take it from the segment).
  uint64_t shm_slot_bytes = 64ull << 20;
  std::string gloo_interface;
};

// What one link of this rank carried over a communicator's life (cumulative;
// callers take differences). `send_busy`: time during which at least one send
// to `peer` was posted and not yet taken, so bytes_sent / send_busy is the
// rate the link sustained while it had work, whatever the rest of the group did.
struct LinkStats {
  int peer = -1;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  std::chrono::nanoseconds send_busy{0};
  // This rank shed that child (GroupOptions::shed_floor): it gets nothing more
  // from this communicator, and the broadcasts completed without it.
  bool shed = false;
  // Bytes/s the link sustained while it had bytes waiting; 0 if it never had.
  double send_rate() const {
    return send_busy.count() > 0 ? static_cast<double>(bytes_sent) / std::chrono::duration<double>(send_busy).count()
                                 : 0;
  }
};

// After a failure, how long a caller waits for its issued Works to settle
// (an aborted communicator completes them within its abort) before it lets
// their buffers go instead of reusing them.
constexpr std::chrono::seconds kSettleTimeout{10};

// What each link carried between two link_stats() snapshots; links that
// sent nothing in between are left out.
inline std::vector<LinkStats> link_delta(const std::vector<LinkStats>& before, const std::vector<LinkStats>& after) {
  std::vector<LinkStats> out;
  for (const auto& a : after) {
    LinkStats d = a;
    for (const auto& b : before)
      if (b.peer == a.peer) {
        d.bytes_sent -= b.bytes_sent;
        d.bytes_received -= b.bytes_received;
        d.send_busy -= b.send_busy;
        d.shed = a.shed && !b.shed;  // shed in this interval
      }
    if (d.bytes_sent > 0 || d.shed) out.push_back(d);
  }
  return out;
}

class Work {
 public:
  virtual ~Work() = default;
  // Waits until the operation finished or `deadline` passed. On deadline the
  // communicator is aborted (a half-done collective cannot be resumed).
  virtual Status wait(Deadline deadline) = 0;
  // After wait() returned: whether the operation can no longer touch its
  // buffer (false only while a backend's abort is still tearing down work
  // that may write it; such a buffer must be let go, not reused).
  virtual bool settled() { return true; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  // Broadcasts `bytes` at `data` from `root` to every rank. `data` is the
  // source on the root and the destination elsewhere; it must stay valid until
  // the returned Work completes. Zero bytes completes at once.
  virtual std::shared_ptr<Work> broadcast(void* data, size_t bytes, int root) = 0;

  // Point-to-point, beside broadcast (the many-sender plan's moves,
  // common/reshard/): sends `bytes` at `data` to rank `peer`, or receives
  // them from `peer` into `data`. A send and a receive meet by their pair and
  // `tag`, which must be unique among the operations in flight between two
  // ranks; their sizes must agree. Asynchronous: the Work completes once the
  // bytes left (a send: the buffer may be reused) or landed (a receive);
  // operations on one pair and direction complete in issue order, those on
  // different pairs run at once. Bounded by the wait's deadline and by the
  // communicator's failure (a broken connection, abort()), as broadcasts are.
  // On the shm plane a sender serves its peer's receives in the order the
  // peer posted them: both ends must issue a pair's moves in one order (the
  // many-sender executor goes round by round on every rank).
  // On NCCL (device memory) a pair's moves meet by issue order, not by tag:
  // both ends issue them in one order, and a rank's moves that must run at
  // once are issued between begin_moves() and end_moves() (below).
  // A backend without them returns a Work failed with kUnavailable.
  virtual std::shared_ptr<Work> send(const void* data, size_t bytes, int peer, uint32_t tag);
  virtual std::shared_ptr<Work> recv(void* data, size_t bytes, int peer, uint32_t tag);
  // The point-to-point moves issued between begin_moves() and end_moves()
  // start together. NCCL needs this: it launches one move at a time in
  // issue order on the communicator's stream, so two ranks that each send
  // to the other before they receive would wait for each other forever;
  // inside one group (ncclGroupStart/ncclGroupEnd) they run at once. A
  // move's Work may be waited on only after end_moves(), which reports a
  // failure to launch the group (each of its Works then fails with it).
  // Host backends run every move at once anyway: no-ops. Same thread as
  // send/recv; groups do not nest.
  virtual void begin_moves() {}
  virtual Status end_moves() { return Status(); }
  // Orders later broadcasts after everything queued so far on `stream` (a
  // cudaStream_t; nullptr = the legacy default stream), on the device,
  // without a host wait. Host backends have no streams: no-op.
  virtual Status order_after(void* stream) {
    (void)stream;
    return Status();
  }

  // Makes every pending and later operation fail fast with kAborted. Never
  // blocks on the backend: a control thread may call it.
  virtual void abort(const std::string& reason) = 0;

  // The first asynchronous failure seen, or OK.
  virtual Status async_error() = 0;

  // Per-link figures, one entry per peer this rank exchanged bytes with;
  // empty where the backend cannot see its links (NCCL). Any thread.
  virtual std::vector<LinkStats> link_stats() { return {}; }
  // The peer this rank itself saw take no bytes for stall_timeout while the
  // others took theirs (its own observation, never a peer's notice), in the
  // group's ranks; -1: none. The shm plane's root sees every reader's
  // progress; other backends say -1. Any thread.
  virtual int stalled_peer() const { return -1; }

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Device device() const = 0;
};

// Creates this rank's communicator; blocks until every rank has joined or
// options.init_timeout passes.
// What a rank saw of its peers when its communicator could not form, in group
// ranks: the peers it could not connect to (refused, reset, a malformed
// address, or not connected within init_timeout) and those whose rendezvous
// address never arrived. The Gloo backend fills it (its pairs connect one by
// one); NCCL and shm cannot tell and leave it empty. Group formation weighs
// every rank's evidence to name the member at fault (group/attribution.h).
struct FormationEvidence {
  std::vector<int> unreachable;
  std::vector<int> no_address;
  // Every pair of this rank's mesh connected, and it failed after (Gloo's
  // "connection closed by peer" when a peer gave up): its word is that it
  // reached every peer.
  bool connected = false;
  bool empty() const { return unreachable.empty() && no_address.empty(); }
};

StatusOr<std::unique_ptr<Communicator>> create_communicator(const GroupOptions& options, Store& store,
                                                            FormationEvidence* evidence = nullptr);

// Mints the bootstrap bytes the root hands to every rank in JoinGroup.
StatusOr<std::string> mint_bootstrap(Backend backend, uint64_t epoch);

// Whether this build and machine can run the backend ("" if yes, else why not).
std::string backend_unavailable_reason(Backend backend);

// Whether a deployment's data plane moves point to point (the many-sender
// plan's moves) in memory of `device`, in a group of `world` ranks (0: not
// known yet): "" if it does (Gloo; shm in host memory, up to 64 ranks), else
// why not. The one rule the publisher asks before planning such an update.
std::string point_to_point_unavailable_reason(Backend backend, bool local, const Device& device, int world = 0);

}  // namespace paramcast
