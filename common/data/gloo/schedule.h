// The stream's shape: how a Gloo-backend broadcast is cut into chunks.
// Internal to data/gloo.
//
// Every rank cuts a broadcast the same way from its size alone (a receive
// must match its send's length, and sizes are all every rank agrees on), so
// the size is the only input. A chunk is one Gloo message and the unit of
// progress: the stall clock (stall_timeout) and the shed window see a link
// move one chunk at a time, and every chunk costs a few messages and
// wake-ups per edge (a send-ready and a receive-ready notice, the data, the
// send's completion). Broadcasts follow each other as one stream, so the
// tree's levels overlap across them: a broadcast up to kMaxChunkBytes is one
// chunk, and a larger one is cut only so that it pipelines through the tree
// too, into equal chunks of at most kMaxChunkBytes. At the 2 MB/s of a slow
// link still worth keeping that is ~2 s a chunk, inside the stall window.
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
constexpr uint64_t receive_window_bytes(std::chrono::milliseconds stall_timeout) {
  const uint64_t ms = stall_timeout.count() > 0 ? static_cast<uint64_t>(stall_timeout.count()) : 0;
  const uint64_t w = kKeptLinkRate * ms / 2000;
  return w < kMaxChunkBytes ? kMaxChunkBytes : w > kWindowBytes ? kWindowBytes : w;
}

// The chunk size of a broadcast of `bytes`: the whole broadcast up to
// kMaxChunkBytes; a larger one in equal chunks of at most that (a multiple
// of 4 KiB, the last one shorter), not a full one and a sliver.
constexpr size_t chunk_bytes_for(size_t bytes) {
  if (bytes <= kMaxChunkBytes) return bytes ? bytes : 1;
  const size_t chunks = (bytes + kMaxChunkBytes - 1) / kMaxChunkBytes;
  const size_t even = (bytes + chunks - 1) / chunks;
  return (even + 4095) / 4096 * 4096;
}

// The slots the chunks travel on: this prefix and the broadcast's sequence
// number, the same on every rank (no Gloo collective uses 0x7d).
constexpr uint8_t kChunkSlotPrefix = 0x7d;

constexpr size_t chunk_count(size_t bytes, size_t chunk) { return (bytes + chunk - 1) / chunk; }

}  // namespace paramcast::gloo_backend
