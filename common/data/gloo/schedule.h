// The stream's shape: how a Gloo-backend broadcast is cut into chunks.
// Internal to data/gloo.
//
// Every rank cuts a broadcast the same way (a receive must match its send's
// length), from its size and the group's settings. A chunk is one Gloo message and the unit of
// progress: the stall clock (stall_timeout) and the shed window see a link
// move one chunk at a time, and every chunk costs a few messages and
// wake-ups per edge (a send-ready and a receive-ready notice, the data, the
// send's completion). Broadcasts follow each other as one stream, so the
// tree's levels overlap across them: a broadcast up to kMaxChunkBytes is one
// chunk, and a larger one is cut only so that it pipelines through the tree
// too, into equal chunks of at most kMaxChunkBytes, less where the stall
// window is short or slow members are shed (max_chunk_bytes()).
//
// Thread-safety: pure functions.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace paramcast::gloo_backend {

constexpr size_t kMaxChunkBytes = size_t(4) << 20;

// Bytes a rank keeps posted ahead of what each child has taken: a link with
// a slow reader holds back its siblings' stream by at most this much.
// Counted in bytes, not chunks, so that a stream of small broadcasts keeps
// as much in flight as a large one (a child late to issue its next
// broadcast stalls nobody while the window lasts).
constexpr uint64_t kWindowBytes = 4 * kMaxChunkBytes;
// Bytes a rank with children receives ahead of what every child has taken,
// so that its parent's link to it moves at the pace of its own slowest link
// (a parent waiting on this rank sees progress while the subtree makes it).
// A rank's next broadcast may also wait for its previous ones to reach its
// children (a staging slot, reused), and its parent then sees no progress
// for as long as this window takes to drain: sized so that behind a link of
// kKeptLinkRate that is at most half the stall window, and never less than
// one chunk nor more than kWindowBytes. Local to the rank (its parent's
// sends match whatever it posts, in order), so it may follow its own
// stall_timeout.
constexpr uint64_t kKeptLinkRate = uint64_t(2) << 20;  // bytes/s
constexpr uint64_t receive_window_bytes(std::chrono::milliseconds stall_timeout, size_t max_chunk = kMaxChunkBytes) {
  const uint64_t ms = stall_timeout.count() > 0 ? static_cast<uint64_t>(stall_timeout.count()) : 0;
  const uint64_t w = kKeptLinkRate * ms / 2000;
  return w < max_chunk ? max_chunk : w > kWindowBytes ? kWindowBytes : w;
}

// The largest chunk of a group: kMaxChunkBytes, less where the group's
// stall window is short, so that a link at kKeptLinkRate moves a chunk in
// half of it, and where slow members are shed, so that a link at the floor
// moves four chunks per shed window (the stall clock and the shed window
// see a link move one chunk at a time); at least kMinChunkBytes, a multiple
// of 4 KiB. Every rank has the same stall_timeout and shed settings (the
// publisher's, in JoinGroup), so every rank cuts alike.
constexpr size_t kMinChunkBytes = size_t(256) << 10;
constexpr size_t max_chunk_bytes(std::chrono::milliseconds stall_timeout, uint64_t shed_floor,
                                 std::chrono::milliseconds shed_window) {
  auto ms = [](std::chrono::milliseconds d) { return d.count() > 0 ? static_cast<uint64_t>(d.count()) : 0; };
  uint64_t cap = kMaxChunkBytes;
  const uint64_t by_stall = kKeptLinkRate * ms(stall_timeout) / 2000;
  if (by_stall < cap) cap = by_stall;
  if (shed_floor > 0) {
    const uint64_t by_shed = shed_floor * ms(shed_window) / 4000;
    if (by_shed < cap) cap = by_shed;
  }
  if (cap < kMinChunkBytes) cap = kMinChunkBytes;
  return static_cast<size_t>(cap / 4096 * 4096);
}

// The chunk size of a broadcast of `bytes`: the whole broadcast up to
// `max_chunk`; a larger one in equal chunks of at most that (a multiple of
// 4 KiB, the last one shorter), not a full one and a sliver.
constexpr size_t chunk_bytes_for(size_t bytes, size_t max_chunk = kMaxChunkBytes) {
  if (bytes <= max_chunk) return bytes ? bytes : 1;
  const size_t chunks = (bytes + max_chunk - 1) / max_chunk;
  const size_t even = (bytes + chunks - 1) / chunks;
  return (even + 4095) / 4096 * 4096;
}

// The slots the chunks travel on: this prefix and the broadcast's sequence
// number, the same on every rank (no Gloo collective uses 0x7d).
constexpr uint8_t kChunkSlotPrefix = 0x7d;
// Point-to-point sends and receives (p2p.cc): this prefix and the caller's
// tag (0x7e is the sentinels').
constexpr uint8_t kP2pSlotPrefix = 0x7c;

constexpr size_t chunk_count(size_t bytes, size_t chunk) { return (bytes + chunk - 1) / chunk; }

}  // namespace paramcast::gloo_backend
