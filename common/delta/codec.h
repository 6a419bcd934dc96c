// DeltaCodec: the delta encoding (delta_codec.h) on the memory a pipeline's
// buckets live in, so that BucketSender, StreamSender and BucketReceiver are
// written once for host and CUDA memory, as DeviceMemory is for copies.
//
//  - host memory: delta_codec.cc on the calling thread; piece hashes xxh64.
//  - CUDA memory (delta/cuda/): compare, compaction (CUB's DeviceSelect and
//    DeviceScan), gap encoding, validation and apply on the device, on the
//    DeviceMemory's copy stream, after everything queued there; piece
//    hashes xxh64-blocks (data/bucket_checksum.h), computed on the device.
//    encode() and apply() return once the bucket is encoded or applied (the
//    host needs the encoding's size to choose it, and apply's validation
//    verdict before it writes).
// Both produce the same wire bytes for the same input (the GPU suite
// compares them); only the piece hash differs, and Header::piece_hash says
// which one a header carries.
//
// The baseline's storage comes from the codec: host memory; CUDA device
// memory, or pinned host memory the device reads through unified
// addressing (publisher.delta.baseline: device | host).
//
// Scratch: the CUDA codec keeps, per pipeline, device scratch of about four
// times the largest bucket it encoded or applied (flags, indices, gaps,
// the encoding), reused across buckets and updates.
//
// Owners: the publisher's update thread holds the codec and the baseline
// (PublisherImpl::codec_, baseline_: the last version every member applied,
// the model's bytes, in `paramcast status`); BucketSender encodes into
// staging and announces each bucket's BucketDelta; BucketReceiver applies
// into the registered buffers, or into the engine's own copy
// (SubscriberImpl::copy_, with subscriber.delta_baseline: host) for tensors
// handed to its callback, and verifies each piece.
//
// Thread-safety: one owning thread (the pipeline's), like DeviceMemory.
#pragma once

#include <memory>
#include <vector>

#include "common/config.h"
#include "common/data/device_memory.h"
#include "common/delta/delta_codec.h"
#include "common/status.h"

namespace paramcast::delta {

class DeltaCodec {
 public:
  virtual ~DeltaCodec() = default;
  // The hash a header's piece_hashes hold for this memory.
  virtual Checksum piece_hash() const = 0;
  // delta::encode for this memory: `segments` (sorted by bucket_offset)
  // hold device pointers on CUDA; `out` is a staging slot of bucket_bytes
  // (it may hold the segments' new bytes: encoding in place). Moves the
  // baseline. Returns the header, piece hashes included.
  virtual StatusOr<Header> encode(const std::vector<Segment>& segments, uint64_t bucket_bytes, uint32_t unit,
                                  bool always, uint8_t* out) = 0;
  // delta::apply for this memory: nothing is written unless the whole
  // encoding is valid (a DATA_CORRUPT error naming the bucket and change).
  virtual Status apply(const Header& h, const uint8_t* wire, uint64_t bucket_bytes,
                       const std::vector<Segment>& segments, const std::string& what) = 0;
  // piece_hash() of each (data, length), in order.
  struct Piece {
    const uint8_t* data;
    uint64_t length;
  };
  virtual StatusOr<std::vector<uint64_t>> hash_pieces(const std::vector<Piece>& pieces) = 0;
  // Storage for a baseline tensor of `bytes` (null when there is none),
  // and its release.
  virtual uint8_t* allocate_baseline(size_t bytes) = 0;
  virtual void free_baseline(uint8_t* p) = 0;
};

// The codec for `mem`'s device; `where` places a CUDA baseline (ignored for
// host memory). Fails for CUDA memory in a build without CUDA.
StatusOr<std::unique_ptr<DeltaCodec>> create_codec(DeviceMemory* mem, Device device,
                                                   DeltaBaseline where = DeltaBaseline::kDevice);

// The host codec (also the reference the CUDA codec is tested against).
std::unique_ptr<DeltaCodec> host_codec();

}  // namespace paramcast::delta
