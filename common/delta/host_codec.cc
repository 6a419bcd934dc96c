// The delta codec on host memory: delta_codec.cc on the calling thread.
#include <new>

#include "common/delta/codec.h"
#include "common/xxhash.h"
#include "paramcast/build_config.h"

namespace paramcast::delta {

#if PARAMCAST_HAVE_NCCL
// delta/cuda/cuda_codec.cc
StatusOr<std::unique_ptr<DeltaCodec>> cuda_codec(DeviceMemory* mem, Device device, DeltaBaseline where);
#endif

namespace {

class HostCodec : public DeltaCodec {
 public:
  Checksum piece_hash() const override { return Checksum::kXxh64; }
  StatusOr<Header> encode(const std::vector<Segment>& segments, uint64_t bucket_bytes, uint32_t unit, bool always,
                          uint8_t* out) override {
    return delta::encode(segments, bucket_bytes, unit, always, out, mask_);
  }
  Status apply(const Header& h, const uint8_t* wire, uint64_t bucket_bytes, const std::vector<Segment>& segments,
               const std::string& what) override {
    return delta::apply(h, wire, bucket_bytes, segments, what, indices_);
  }
  StatusOr<std::vector<uint64_t>> hash_pieces(const std::vector<Piece>& pieces) override {
    std::vector<uint64_t> out;
    out.reserve(pieces.size());
    for (const auto& p : pieces) out.push_back(xxh64(p.data, p.length));
    return out;
  }
  uint8_t* allocate_baseline(size_t bytes) override { return new (std::nothrow) uint8_t[bytes ? bytes : 1]; }
  void free_baseline(uint8_t* p) override { delete[] p; }

 private:
  std::vector<uint8_t> mask_;       // encoding scratch, reused
  std::vector<uint8_t> indices_;   // decoding scratch (the index stream), reused
};

}  // namespace

std::unique_ptr<DeltaCodec> host_codec() { return std::make_unique<HostCodec>(); }

StatusOr<std::unique_ptr<DeltaCodec>> create_codec(DeviceMemory* mem, Device device, DeltaBaseline where) {
  if (!device.is_cuda()) return host_codec();
#if PARAMCAST_HAVE_NCCL
  return cuda_codec(mem, device, where);
#else
  (void)mem;
  (void)where;
  return unavailable("delta updates of CUDA tensors need a build with CUDA (PARAMCAST_WITH_NCCL)");
#endif
}

}  // namespace paramcast::delta
