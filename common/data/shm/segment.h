// Segment: the shared memory of one shm group (one epoch), and how it
// reaches the group's other ranks.
//
// The root creates it with memfd_create: it has no name in any file system
// (nothing can be left behind in /dev/shm, even after a SIGKILL) and is
// freed when the last process that maps it unmaps it or exits. The root
// hands the descriptor to each reader over a Unix socket in the abstract
// namespace (SCM_RIGHTS), named by the bootstrap the control plane gave
// every rank in JoinGroup (CURVE-authenticated where configured), and only
// to a peer that runs as the same user (SO_PEERCRED) and presents the
// bootstrap's 32-byte secret: the socket's name is visible to the host, the
// secret is not. The socket closes once every reader attached.
//
// Layout: a 64 KiB header (ShmHeader: the ring's counters, each rank's pid,
// the abort word), then kSlots slots of slot_bytes (host memory), or nothing
// more when the slots are CUDA memory (slots.h); then, in a host-memory
// group of 2 to kP2pMaxRanks ranks, one point-to-point channel per ordered
// pair of ranks (p2p.h), whose pages are backed only where a pair moves
// bytes.
//
// Thread-safety: host() and attach() from one thread; the mapping is shared.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace paramcast::shm_backend {

inline constexpr uint32_t kMagic = 0x70637368;  // "pcsh"
inline constexpr uint32_t kLayoutVersion = 2;
inline constexpr int kSlots = 2;
inline constexpr int kMaxRanks = 1024;
inline constexpr uint64_t kHeaderBytes = 64 << 10;
inline constexpr uint64_t kMaxSlotBytes = 1ull << 30;
// Point-to-point channels (p2p.h): a control page and kP2pChunks chunks.
inline constexpr int kP2pMaxRanks = 64;
inline constexpr uint64_t kP2pControlBytes = 16 << 10;
inline constexpr uint64_t kP2pChunkBytes = 512 << 10;
inline constexpr int kP2pChunks = 2;
inline constexpr uint64_t kP2pChannelBytes = kP2pControlBytes + kP2pChunks * kP2pChunkBytes;
// Bytes of the point-to-point channels of a group (0: none; the channel of
// ranks (a, b) is number a * world + b).
inline uint64_t p2p_area_bytes(int world, bool host_slots) {
  return host_slots && world > 1 && world <= kP2pMaxRanks ? static_cast<uint64_t>(world) * world * kP2pChannelBytes
                                                          : 0;
}

// The shared header. Atomics in shared memory: lock-free 32/64-bit words
// (std::atomic of those sizes is address-free on the platforms we build for).
struct ShmHeader {
  uint32_t magic;
  uint32_t layout_version;
  uint32_t world;
  uint32_t slots;
  uint64_t slot_bytes;
  std::atomic<uint32_t> futex;       // bumped after every change a waiter may wait for
  std::atomic<uint32_t> abort_word;  // 0, or (kind << 24) | (blamed rank + 1)
  std::atomic<uint32_t> closed;      // 1: the root's communicator is gone (its readers stop waiting)
  std::atomic<uint64_t> published;   // chunks the root has written
  uint64_t slot_len[kSlots];         // bytes of the chunk a slot holds (written before `published`)
  uint64_t slot_op[kSlots];          // which broadcast (counted from 1) the chunk belongs to
  uint64_t slot_offset[kSlots];      // and where in it: readers check both against their own
  uint32_t cuda;                     // 1: the slots are CUDA memory, shared by the IPC handles below
  uint8_t ipc[kSlots][64];           // cudaIpcMemHandle_t of each slot (cuda)
  std::atomic<int32_t> pid[kMaxRanks];        // each rank's pid as it says (diagnostics only: never trusted)
  std::atomic<uint32_t> p2p_wake[kP2pMaxRanks];  // each rank's point-to-point futex word (p2p.h)
  std::atomic<uint64_t> consumed[kMaxRanks];  // chunks each reader has copied out
};
static_assert(sizeof(ShmHeader) <= kHeaderBytes, "ShmHeader must fit its 64 KiB");
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free);

// What the bootstrap carries: the socket's name and the secret.
struct Bootstrap {
  std::string name;    // 32 hex characters
  std::string secret;  // 32 bytes
  static StatusOr<Bootstrap> parse(const std::string& bytes);
  static StatusOr<std::string> mint();
  // The bootstrap bytes with another secret (a reader's own).
  std::string with_secret(const std::string& secret) const { return "shm1:" + name + ":" + secret; }
};

class Segment {
 public:
  ~Segment();
  // Root: creates the segment for `world` ranks (with its slots in it when
  // `host_slots`), lets `prepare` fill the header before any reader can
  // see it, serves it to every reader, and returns once all attached or
  // `timeout` passed (the error names the ranks that did not attach, by
  // `members`, and `missing` lists them). `rank_secrets` (by rank, may be
  // empty): the secret each reader must present, its own.
  static StatusOr<std::unique_ptr<Segment>> host(const Bootstrap& b, int world, uint64_t slot_bytes,
                                                 bool host_slots, std::chrono::milliseconds timeout,
                                                 const std::vector<std::string>& members,
                                                 const std::function<Status(ShmHeader&)>& prepare,
                                                 const std::vector<std::string>& rank_secrets = {},
                                                 std::vector<int>* missing = nullptr);
  // Reader `rank`: connects (the root may not listen yet: retried until
  // `timeout`), receives the descriptor and maps the segment.
  static StatusOr<std::unique_ptr<Segment>> attach(const Bootstrap& b, int rank, int world,
                                                   std::chrono::milliseconds timeout);

  ShmHeader& header() const { return *reinterpret_cast<ShmHeader*>(base_); }
  // The slot size as this process validated it (never re-read from the
  // shared header, which any reader could overwrite).
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint8_t* slot(uint64_t chunk) const { return base_ + kHeaderBytes + (chunk % kSlots) * slot_bytes_; }
  // The point-to-point channels (p2p_area_bytes), or nullptr when the group has none.
  // Set once at host() or attach(), from the layout this process validated
  // (never re-read from the shared header, which any reader could overwrite).
  uint8_t* p2p_area() const { return p2p_; }
  bool cuda() const { return cuda_; }
  // A peer's pid as the kernel gave it (SO_PEERCRED, in this process's pid
  // namespace; 0 when it is not visible there): the root knows each
  // reader's, a reader the root's (rank 0).
  int32_t peer_pid(int rank) const {
    return rank >= 0 && rank < static_cast<int>(peer_pids_.size()) ? peer_pids_[rank] : 0;
  }

 private:
  Segment(uint8_t* base, size_t bytes, uint64_t slot_bytes) : base_(base), bytes_(bytes), slot_bytes_(slot_bytes) {}
  uint8_t* base_;
  size_t bytes_;
  uint64_t slot_bytes_;
  uint8_t* p2p_ = nullptr;
  bool cuda_ = false;
  std::vector<int32_t> peer_pids_;
};

}  // namespace paramcast::shm_backend
