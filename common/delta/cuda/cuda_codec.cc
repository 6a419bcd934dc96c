// The delta codec on CUDA memory: delta_kernels.cu's steps on the
// DeviceMemory's copy stream, with the host reading back only counters
// (how many units changed, the encoding's size, the first bad change).
//
// Encode: piece hashes (xxh64-blocks, one batched kernel); compare (the
// dense bucket packed into `out`, the changed units flagged and counted, the
// baseline moved); then, when a delta can be worth it, CUB compacts the
// changed units' indices and values, an inclusive sum lays out the LEB128
// gaps, and the encoding replaces the dense bytes in `out`. Apply: the
// header is checked on the host, the gaps or the bitmask decoded and every
// index validated on the device, and only then the values scattered.
//
// Scratch is device memory from the DeviceMemory (counted in its peak),
// sized by what a bucket needs (a few bytes per changed unit, one flag byte
// per unit), grown when a bucket needs more and kept; the host side of the
// counters, segment tables and digests is pinned.
//
// Thread-safety: one owning thread (the pipeline's); every call saves and
// restores the caller's current device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "common/data/bucket_checksum.h"
#include "common/data/nccl/device_guard.h"
#include "common/data/nccl/kernels.h"
#include "common/data/nccl/nccl_check.h"
#include "common/delta/codec.h"
#include "common/delta/cuda/delta_kernels.h"

namespace paramcast::delta {
namespace {

using nccl_backend::DeviceGuard;

constexpr size_t kAlign = 256;
size_t aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A device buffer from the DeviceMemory that only grows. Released only after
// the stream drained (queued work may still use it).
class DeviceScratch {
 public:
  DeviceScratch(DeviceMemory* mem, cudaStream_t stream) : mem_(mem), stream_(stream) {}
  ~DeviceScratch() { reset(); }
  StatusOr<uint8_t*> need(size_t bytes) {
    if (bytes <= size_) return ptr_;
    reset();
    auto p = mem_->allocate(aligned(std::max<size_t>(bytes, 1)));
    if (!p.ok()) return p.status().with_context("delta scratch");
    ptr_ = static_cast<uint8_t*>(*p);
    size_ = aligned(std::max<size_t>(bytes, 1));
    return ptr_;
  }

 private:
  void reset() {
    if (!ptr_) return;
    cudaStreamSynchronize(stream_);
    mem_->release(ptr_);
    ptr_ = nullptr;
    size_ = 0;
  }
  DeviceMemory* mem_;
  cudaStream_t stream_;
  uint8_t* ptr_ = nullptr;
  size_t size_ = 0;
};

// Pinned host memory that only grows (its previous contents are dropped).
class PinnedScratch {
 public:
  ~PinnedScratch() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  StatusOr<uint8_t*> need(size_t bytes) {
    if (bytes <= size_) return ptr_;
    if (ptr_) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    size_ = 0;
    PC_CUDA_RETURN(cudaMallocHost(reinterpret_cast<void**>(&ptr_), std::max<size_t>(bytes, 64)));
    size_ = std::max<size_t>(bytes, 64);
    return ptr_;
  }

 private:
  uint8_t* ptr_ = nullptr;
  size_t size_ = 0;
};

class CudaCodec : public DeltaCodec {
 public:
  CudaCodec(DeviceMemory* mem, int index, DeltaBaseline where)
      : mem_(mem),
        stream_(static_cast<cudaStream_t>(mem->stream())),
        index_(index),
        where_(where),
        work_(mem, stream_),
        flags_(mem, stream_),
        segments_(mem, stream_),
        digests_(mem, stream_),
        counters_(mem, stream_) {}

  Checksum piece_hash() const override { return Checksum::kXxh64Blocks; }
  StatusOr<Header> encode(const std::vector<Segment>& segments, uint64_t bucket_bytes, uint32_t unit, bool always,
                          uint8_t* out) override;
  Status apply(const Header& h, const uint8_t* wire, uint64_t bucket_bytes, const std::vector<Segment>& segments,
               const std::string& what) override;
  StatusOr<std::vector<uint64_t>> hash_pieces(const std::vector<Piece>& pieces) override;
  uint8_t* allocate_baseline(size_t bytes) override {
    DeviceGuard g(index_);
    void* p = nullptr;
    const cudaError_t e = where_ == DeltaBaseline::kDevice
                              ? cudaMalloc(&p, std::max<size_t>(bytes, 1))
                              : cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return static_cast<uint8_t*>(p);
  }
  void free_baseline(uint8_t* p) override {
    if (!p) return;
    DeviceGuard g(index_);
    cudaStreamSynchronize(stream_);  // queued compares may still read it
    if (where_ == DeltaBaseline::kDevice) cudaFree(p);
    else cudaFreeHost(p);
  }

 private:
  // The segments' device table, uploaded on the stream.
  StatusOr<const cuda::DeviceSegment*> upload(const std::vector<Segment>& segments);
  // Clears the device counters (bad = ~0).
  Status reset_counters();
  // Copies the device counters back and waits for everything queued.
  StatusOr<cuda::Counters> read_counters();
  Status dense(const std::vector<Segment>& segments, uint64_t bucket_bytes, uint8_t* out, Header& h);

  DeviceMemory* mem_;
  cudaStream_t stream_;
  int index_;
  DeltaBaseline where_;
  DeviceScratch work_, flags_, segments_, digests_, counters_;
  PinnedScratch host_segments_, host_digests_, host_counters_;
};

StatusOr<const cuda::DeviceSegment*> CudaCodec::upload(const std::vector<Segment>& segments) {
  const size_t bytes = segments.size() * sizeof(cuda::DeviceSegment);
  auto host = host_segments_.need(bytes);
  if (!host.ok()) return host.status();
  auto* table = reinterpret_cast<cuda::DeviceSegment*>(*host);
  for (size_t i = 0; i < segments.size(); ++i)
    table[i] = {segments[i].now, segments[i].base, segments[i].bucket_offset, segments[i].length};
  auto dev = segments_.need(bytes);
  if (!dev.ok()) return dev.status();
  if (bytes) PC_CUDA_RETURN(cudaMemcpyAsync(*dev, table, bytes, cudaMemcpyHostToDevice, stream_));
  return reinterpret_cast<const cuda::DeviceSegment*>(*dev);
}

Status CudaCodec::reset_counters() {
  auto c = counters_.need(sizeof(cuda::Counters));
  if (!c.ok()) return c.status();
  PC_CUDA_RETURN(cudaMemsetAsync(*c, 0, sizeof(cuda::Counters), stream_));
  PC_CUDA_RETURN(cudaMemsetAsync(*c + offsetof(cuda::Counters, bad), 0xff, sizeof(unsigned long long), stream_));
  return Status();
}

StatusOr<cuda::Counters> CudaCodec::read_counters() {
  auto host = host_counters_.need(sizeof(cuda::Counters));
  if (!host.ok()) return host.status();
  auto dev = counters_.need(sizeof(cuda::Counters));
  if (!dev.ok()) return dev.status();
  PC_CUDA_RETURN(cudaMemcpyAsync(*host, *dev, sizeof(cuda::Counters), cudaMemcpyDeviceToHost, stream_));
  PC_CUDA_RETURN(cudaStreamSynchronize(stream_));
  cuda::Counters c;
  std::memcpy(&c, *host, sizeof c);
  return c;
}

StatusOr<std::vector<uint64_t>> CudaCodec::hash_pieces(const std::vector<Piece>& pieces) {
  DeviceGuard g(index_);
  std::vector<uint64_t> first(pieces.size());
  uint64_t blocks = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    first[i] = blocks;
    blocks += checksum_blocks(pieces[i].length);
  }
  std::vector<uint64_t> out(pieces.size());
  if (blocks > 0) {
    const size_t table_bytes = pieces.size() * sizeof(nccl_backend::PieceDesc);
    auto host_table = host_segments_.need(table_bytes);
    if (!host_table.ok()) return host_table.status();
    auto* table = reinterpret_cast<nccl_backend::PieceDesc*>(*host_table);
    for (size_t i = 0; i < pieces.size(); ++i) table[i] = {pieces[i].data, pieces[i].length, first[i]};
    auto dev_table = segments_.need(table_bytes);
    if (!dev_table.ok()) return dev_table.status();
    auto dev_digests = digests_.need(blocks * sizeof(uint64_t));
    if (!dev_digests.ok()) return dev_digests.status();
    auto host_digests = host_digests_.need(blocks * sizeof(uint64_t));
    if (!host_digests.ok()) return host_digests.status();
    PC_CUDA_RETURN(cudaMemcpyAsync(*dev_table, table, table_bytes, cudaMemcpyHostToDevice, stream_));
    PC_CUDA_RETURN(nccl_backend::launch_piece_digests(reinterpret_cast<const nccl_backend::PieceDesc*>(*dev_table),
                                                      static_cast<uint32_t>(pieces.size()), blocks,
                                                      reinterpret_cast<uint64_t*>(*dev_digests), stream_));
    PC_CUDA_RETURN(cudaMemcpyAsync(*host_digests, *dev_digests, blocks * sizeof(uint64_t), cudaMemcpyDeviceToHost,
                                   stream_));
    PC_CUDA_RETURN(cudaStreamSynchronize(stream_));
    const auto* d = reinterpret_cast<const uint64_t*>(*host_digests);
    for (size_t i = 0; i < pieces.size(); ++i)
      out[i] = combine_block_digests(d + first[i], checksum_blocks(pieces[i].length), pieces[i].length);
  } else {
    for (size_t i = 0; i < pieces.size(); ++i) out[i] = combine_block_digests(nullptr, 0, 0);
  }
  return out;
}

// The dense bucket into `out` and the baseline (queued, not waited on).
Status CudaCodec::dense(const std::vector<Segment>& segments, uint64_t bucket_bytes, uint8_t* out, Header& h) {
  std::vector<DeviceMemory::CopyOp> ops;
  ops.reserve(2 * segments.size());
  for (const auto& s : segments) {
    if (!s.length) continue;
    if (s.now != out + s.bucket_offset) ops.push_back({out + s.bucket_offset, s.now, s.length});
    ops.push_back({s.base, s.now, s.length});
  }
  PC_RETURN_IF_ERROR(mem_->copy_many(ops));
  h.kind = Kind::kDense;
  h.wire_bytes = bucket_bytes;
  h.changed = 0;
  return Status();
}

StatusOr<Header> CudaCodec::encode(const std::vector<Segment>& segments, uint64_t bucket_bytes, uint32_t unit,
                                   bool always, uint8_t* out) {
  DeviceGuard g(index_);
  Header h;
  h.unit = unit;
  h.piece_hash = Checksum::kXxh64Blocks;
  std::vector<Piece> pieces;
  pieces.reserve(segments.size());
  for (const auto& s : segments) pieces.push_back({s.now, s.length});
  auto hashes = hash_pieces(pieces);  // before `out` (maybe the new bytes themselves) is overwritten
  if (!hashes.ok()) return hashes.status();
  h.piece_hashes = std::move(*hashes);

  const uint64_t units = bucket_bytes / unit;
  const uint64_t budget = always ? (bucket_bytes ? bucket_bytes - 1 : 0) : bucket_bytes / 2;
  const uint64_t limit = units <= kMaxDeltaUnits ? budget / unit : 0;
  bool fits = units <= kMaxDeltaUnits && bucket_bytes % unit == 0;
  uint64_t longest = 0;
  for (const auto& s : segments) {
    fits = fits && s.bucket_offset % unit == 0 && s.length % unit == 0 &&
           reinterpret_cast<uintptr_t>(s.now) % unit == 0 && reinterpret_cast<uintptr_t>(s.base) % unit == 0;
    longest = std::max(longest, s.length);
  }
  if (!fits) {
    PC_RETURN_IF_ERROR(dense(segments, bucket_bytes, out, h));
    return h;
  }
  // Compare: the dense bucket in `out`, the flags, the count; baseline moved.
  auto flags = flags_.need(aligned(units));
  if (!flags.ok()) return flags.status();
  PC_CUDA_RETURN(cudaMemsetAsync(*flags, 0, units, stream_));
  PC_RETURN_IF_ERROR(reset_counters());
  auto table = upload(segments);
  if (!table.ok()) return table.status();
  auto* counters = reinterpret_cast<cuda::Counters*>(*counters_.need(sizeof(cuda::Counters)));
  PC_CUDA_RETURN(cuda::launch_compare(*table, static_cast<uint32_t>(segments.size()), longest, unit, out, *flags,
                                      counters, stream_));
  auto c = read_counters();
  if (!c.ok()) return c.status();
  const uint64_t changed = c->changed;
  if (changed == 0) {
    h.kind = Kind::kUnchanged;
    return h;
  }
  h.wire_bytes = bucket_bytes;  // dense, unless a delta turns out smaller
  if (changed > limit) return h;
  // Compact: indices and values, then the gaps' layout.
  size_t select_temp = 0, scan_temp = 0;
  PC_CUDA_RETURN(cuda::select_changes(nullptr, select_temp, out, *flags, units, unit, nullptr, nullptr, counters,
                                      stream_));
  PC_CUDA_RETURN(cuda::gap_layout(nullptr, scan_temp, nullptr, changed, nullptr, counters, stream_));
  const size_t at_indices = 0, at_ends = at_indices + aligned(changed * 4),
               at_values = at_ends + aligned(changed * 8), at_temp = at_values + aligned(changed * (unit + 5ull)),
               total = at_temp + aligned(std::max(select_temp, scan_temp));
  auto base = work_.need(total);
  if (!base.ok()) return base.status();
  uint8_t* w = *base;
  auto* indices = reinterpret_cast<uint32_t*>(w + at_indices);
  auto* ends = reinterpret_cast<uint64_t*>(w + at_ends);
  uint8_t* values = w + at_values;
  void* temp = w + at_temp;
  size_t temp_bytes = std::max(select_temp, scan_temp);
  PC_CUDA_RETURN(cuda::select_changes(temp, temp_bytes, out, *flags, units, unit, indices, values, counters, stream_));
  temp_bytes = std::max(select_temp, scan_temp);
  PC_CUDA_RETURN(cuda::gap_layout(temp, temp_bytes, indices, changed, ends, counters, stream_));
  c = read_counters();
  if (!c.ok()) return c.status();
  if (static_cast<uint64_t>(c->selected) != changed)
    return internal_error("delta encode: compare counted " + std::to_string(changed) + " changed units, compaction " +
                          std::to_string(c->selected));
  const uint64_t by_index = changed * unit + c->gap_bytes;
  const uint64_t by_mask = bitmask_bytes(units, changed, unit);
  if (std::min(by_index, by_mask) > budget) return h;  // dense: `out` holds it
  h.changed = changed;
  uint8_t* tail = values + changed * unit;
  if (by_index <= by_mask) {
    h.kind = Kind::kIndices;
    h.wire_bytes = by_index;
    PC_CUDA_RETURN(cuda::write_gaps(indices, ends, changed, tail, stream_));
  } else {
    h.kind = Kind::kBitmask;
    h.wire_bytes = by_mask;
    PC_CUDA_RETURN(cuda::write_bitmask(*flags, units, tail, stream_));
  }
  // The encoding replaces the dense bytes; the broadcast is ordered after
  // the copy stream by the caller.
  PC_CUDA_RETURN(cudaMemcpyAsync(out, values, h.wire_bytes, cudaMemcpyDeviceToDevice, stream_));
  return h;
}

Status CudaCodec::apply(const Header& h, const uint8_t* wire, uint64_t bucket_bytes,
                        const std::vector<Segment>& segments, const std::string& what) {
  PC_RETURN_IF_ERROR(check_header(h, bucket_bytes, segments.size(), what));
  if (h.kind != Kind::kIndices && h.kind != Kind::kBitmask) return Status();
  for (const auto& seg : segments)
    if (seg.bucket_offset % h.unit || seg.length % h.unit)
      return data_corrupt("delta of " + what + ": a piece at byte " + std::to_string(seg.bucket_offset) + " of " +
                          std::to_string(seg.length) + " bytes is not whole units of " + std::to_string(h.unit));
  DeviceGuard g(index_);
  const uint64_t units = bucket_bytes / h.unit;
  const uint64_t changed = h.changed;
  const uint8_t* tail = wire + changed * h.unit;
  const uint64_t tail_bytes = h.wire_bytes - changed * h.unit;
  if (h.kind == Kind::kIndices && tail_bytes > 0xffffffffull)
    return data_corrupt("delta of " + what + ": " + std::to_string(tail_bytes) + " bytes of gaps");
  // Scratch: flags or terminators, the gap ends, the indices, CUB's temp.
  const uint64_t marks = h.kind == Kind::kIndices ? tail_bytes : units;
  size_t temp_bytes = 0;
  if (h.kind == Kind::kIndices)
    PC_CUDA_RETURN(cuda::decode_gaps(nullptr, temp_bytes, tail, tail_bytes, changed, nullptr, nullptr, nullptr,
                                     nullptr, stream_));
  else
    PC_CUDA_RETURN(cuda::select_marked(nullptr, temp_bytes, nullptr, units, nullptr, nullptr, stream_));
  const size_t at_ends = aligned(marks), at_indices = at_ends + aligned(changed * 4),
               at_temp = at_indices + aligned(changed * 8), total = at_temp + aligned(temp_bytes);
  auto base = work_.need(total);
  if (!base.ok()) return base.status();
  uint8_t* marks_at = *base;
  auto* ends = reinterpret_cast<uint32_t*>(*base + at_ends);
  auto* indices = reinterpret_cast<uint64_t*>(*base + at_indices);
  void* temp = *base + at_temp;
  PC_RETURN_IF_ERROR(reset_counters());
  auto* counters = reinterpret_cast<cuda::Counters*>(*counters_.need(sizeof(cuda::Counters)));
  auto bad = [&](const std::string& why) { return data_corrupt("delta of " + what + ": " + why); };
  // Step 1: count what the encoding marks, before anything depends on it.
  if (h.kind == Kind::kIndices)
    PC_CUDA_RETURN(cuda::count_terminators(tail, tail_bytes, marks_at, counters, stream_));
  else
    PC_CUDA_RETURN(cuda::expand_bitmask(tail, units, marks_at, counters, stream_));
  auto c = read_counters();
  if (!c.ok()) return c.status();
  const uint64_t found = static_cast<uint64_t>(c->selected);
  if (h.kind == Kind::kIndices) {
    if (found < changed || (found == changed && !c->last_ends))
      return bad("gap #" + std::to_string(std::min(found, changed - 1)) + " is cut short or too long");
    if (found > changed)
      return bad(std::to_string(found - changed) + " gaps left after its " + std::to_string(changed) + " changes");
  } else if (c->bad != ~0ull || found != changed) {
    return bad("the bitmask marks " + std::to_string(found) + " units" +
               (c->bad != ~0ull ? ", one past the bucket" : "") + ", its header " + std::to_string(changed));
  }
  // Step 2: the indices, then every one validated.
  if (h.kind == Kind::kIndices)
    PC_CUDA_RETURN(cuda::decode_gaps(temp, temp_bytes, tail, tail_bytes, changed, marks_at, ends, indices, counters,
                                     stream_));
  else
    PC_CUDA_RETURN(cuda::select_marked(temp, temp_bytes, marks_at, units, indices, counters, stream_));
  auto table = upload(segments);
  if (!table.ok()) return table.status();
  const auto count = static_cast<uint32_t>(segments.size());
  PC_CUDA_RETURN(cuda::validate(indices, changed, units, h.unit, *table, count, counters, stream_));
  c = read_counters();
  if (!c.ok()) return c.status();
  if (c->bad != ~0ull) {
    const uint64_t k = c->bad >> 3;
    switch (static_cast<cuda::BadReason>(c->bad & 7)) {
      case cuda::kGapTooLong: return bad("gap #" + std::to_string(k) + " is cut short or too long");
      case cuda::kPastBucket:
        return bad("change #" + std::to_string(k) + " lies past the bucket's " + std::to_string(units) + " units");
      case cuda::kBetweenPieces: return bad("change #" + std::to_string(k) + " lies between the bucket's tensors");
      default: return bad("the bitmask marks a unit past the bucket");
    }
  }
  // Step 3: write.
  PC_CUDA_RETURN(cuda::scatter(indices, wire, changed, h.unit, *table, count, stream_));
  PC_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status();
}

}  // namespace

StatusOr<std::unique_ptr<DeltaCodec>> cuda_codec(DeviceMemory* mem, Device device, DeltaBaseline where) {
  if (!mem || !mem->stream()) return invalid_argument("the CUDA delta codec needs CUDA device memory");
  return std::unique_ptr<DeltaCodec>(new CudaCodec(mem, device.index, where));
}

}  // namespace paramcast::delta
