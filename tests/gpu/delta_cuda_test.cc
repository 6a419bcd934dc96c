// The CUDA delta codec (common/delta/cuda/) against the host codec, its
// reference: the same buckets encoded on both give the same kind, counts and
// wire bytes, and move the baseline the same way; the device's piece hashes
// are xxh64-blocks of the new bytes; a device apply lands the new bytes;
// hostile encodings are refused by both, with nothing written on the device.
// Every test skips, saying so, where there is no CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/data/bucket_checksum.h"
#include "common/data/device_memory.h"
#include "common/delta/codec.h"
#include "tests/support/process.h"

namespace paramcast::delta {
namespace {

struct Layout {
  uint32_t unit;
  std::vector<std::pair<uint64_t, uint64_t>> pieces;  // bucket offset, length
  uint64_t bytes;
};

// Pieces of whole units at 256-byte aligned offsets, as the planner lays them out.
Layout make_layout(uint32_t unit, std::vector<uint64_t> lengths) {
  Layout l{unit, {}, 0};
  for (uint64_t n : lengths) {
    const uint64_t at = (l.bytes + 255) / 256 * 256;
    l.pieces.push_back({at, n});
    l.bytes = at + n;
  }
  return l;
}

class CudaDeltaTest : public ::testing::TestWithParam<DeltaBaseline> {
 protected:
  void SetUp() override {
    if (test::cuda_devices() == 0) GTEST_SKIP() << "no CUDA device on this machine (GPU tests run in tests/gpu/run.sh)";
    auto m = create_device_memory(Device::cuda(0));
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    mem_ = std::move(m.value());
    auto c = create_codec(mem_.get(), Device::cuda(0), GetParam());
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    codec_ = std::move(c.value());
  }
  uint8_t* device_copy(const std::vector<uint8_t>& host) {
    auto* p = static_cast<uint8_t*>(mem_->allocate(std::max<size_t>(host.size(), 1)).value());
    EXPECT_TRUE(mem_->copy(p, host.data(), host.size()).ok());
    return p;
  }
  uint8_t* baseline_copy(const std::vector<uint8_t>& host) {
    uint8_t* p = codec_->allocate_baseline(host.size());
    EXPECT_NE(p, nullptr);
    EXPECT_TRUE(mem_->copy(p, host.data(), host.size()).ok());
    return p;
  }
  std::vector<uint8_t> download(const uint8_t* p, size_t n) {
    std::vector<uint8_t> out(n);
    EXPECT_TRUE(mem_->copy(out.data(), p, n).ok());
    return out;
  }

  // Encodes `now` against `old` (per-piece byte vectors) on both codecs and
  // compares everything; then applies the device encoding on the device
  // onto `old` and checks it lands `now`. Returns the kind.
  Kind round_trip(const Layout& l, const std::vector<std::vector<uint8_t>>& old,
                  const std::vector<std::vector<uint8_t>>& now, bool always) {
    // Host reference.
    std::vector<std::vector<uint8_t>> host_base = old;
    std::vector<Segment> hs;
    for (size_t i = 0; i < l.pieces.size(); ++i)
      hs.push_back({now[i].data(), host_base[i].data(), l.pieces[i].first, l.pieces[i].second});
    std::vector<uint8_t> host_out(l.bytes);
    auto host = host_codec()->encode(hs, l.bytes, l.unit, always, host_out.data());
    EXPECT_TRUE(host.ok());
    // Device.
    std::vector<uint8_t*> dnow, dbase;
    std::vector<Segment> ds;
    for (size_t i = 0; i < l.pieces.size(); ++i) {
      dnow.push_back(device_copy(now[i]));
      dbase.push_back(baseline_copy(old[i]));
      ds.push_back({dnow[i], dbase[i], l.pieces[i].first, l.pieces[i].second});
    }
    uint8_t* dout = device_copy(std::vector<uint8_t>(l.bytes, 0xee));
    auto dev = codec_->encode(ds, l.bytes, l.unit, always, dout);
    EXPECT_TRUE(dev.ok()) << dev.status().to_string();
    if (!dev.ok() || !host.ok()) return Kind::kDense;
    EXPECT_TRUE(mem_->synchronize().ok());
    EXPECT_EQ(dev->kind, host->kind) << "unit " << l.unit;
    EXPECT_EQ(dev->changed, host->changed);
    EXPECT_EQ(dev->wire_bytes, host->wire_bytes);
    EXPECT_EQ(dev->piece_hash, Checksum::kXxh64Blocks);
    auto wire = download(dout, dev->wire_bytes);
    if (host->kind == Kind::kIndices || host->kind == Kind::kBitmask) {
      EXPECT_EQ(0, std::memcmp(wire.data(), host_out.data(), dev->wire_bytes)) << kind_name(host->kind);
    } else if (host->kind == Kind::kDense) {
      for (size_t i = 0; i < l.pieces.size(); ++i)
        EXPECT_EQ(0, std::memcmp(wire.data() + l.pieces[i].first, now[i].data(), l.pieces[i].second));
    }
    for (size_t i = 0; i < l.pieces.size(); ++i) {
      EXPECT_EQ(download(dbase[i], now[i].size()), now[i]) << "baseline of piece " << i << " moved to the new bytes";
      EXPECT_EQ(dev->piece_hashes[i], host_checksum(Checksum::kXxh64Blocks, now[i].data(), now[i].size()));
    }
    // Apply on the device onto the old bytes.
    if (dev->kind == Kind::kIndices || dev->kind == Kind::kBitmask) {
      std::vector<uint8_t*> dest;
      std::vector<Segment> as;
      for (size_t i = 0; i < l.pieces.size(); ++i) {
        dest.push_back(device_copy(old[i]));
        as.push_back({nullptr, dest[i], l.pieces[i].first, l.pieces[i].second});
      }
      Status s = codec_->apply(*dev, dout, l.bytes, as, "bucket 0 of v2");
      EXPECT_TRUE(s.ok()) << s.to_string();
      std::vector<DeltaCodec::Piece> pieces;
      for (size_t i = 0; i < l.pieces.size(); ++i) {
        EXPECT_EQ(download(dest[i], now[i].size()), now[i]) << "piece " << i;
        pieces.push_back({dest[i], l.pieces[i].second});
      }
      auto hashes = codec_->hash_pieces(pieces);
      EXPECT_TRUE(hashes.ok());
      if (hashes.ok()) {
        EXPECT_EQ(*hashes, dev->piece_hashes);
      }
      for (auto* p : dest) mem_->release(p);
    }
    for (auto* p : dnow) mem_->release(p);
    for (auto* p : dbase) codec_->free_baseline(p);
    mem_->release(dout);
    return host->kind;
  }

  std::unique_ptr<DeviceMemory> mem_;
  std::unique_ptr<DeltaCodec> codec_;
};

// Random old bytes; `fraction` of the units changed in the new ones.
void fill(const Layout& l, double fraction, uint32_t seed, std::vector<std::vector<uint8_t>>& old,
          std::vector<std::vector<uint8_t>>& now) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> coin(0, 1);
  old.clear();
  now.clear();
  for (const auto& [off, n] : l.pieces) {
    std::vector<uint8_t> a(n);
    for (auto& b : a) b = static_cast<uint8_t>(rng());
    std::vector<uint8_t> b = a;
    for (uint64_t u = 0; u < n; u += l.unit)
      if (coin(rng) < fraction) b[u + rng() % l.unit] ^= static_cast<uint8_t>(1 + rng() % 255);
    old.push_back(std::move(a));
    now.push_back(std::move(b));
  }
}

TEST_P(CudaDeltaTest, EncodesAsTheHostCodecDoesAndAppliesBitExact) {
  for (uint32_t unit : {1u, 2u, 4u, 8u}) {
    const Layout l = make_layout(unit, {unit * 3000ull, unit * 1ull, unit * 70000ull, 0, unit * 513ull});
    for (double fraction : {0.0, 0.0005, 0.03, 0.2, 0.45, 0.9}) {
      std::vector<std::vector<uint8_t>> old, now;
      fill(l, fraction, unit * 1000 + static_cast<uint32_t>(fraction * 1000), old, now);
      for (bool always : {false, true}) {
        SCOPED_TRACE("unit " + std::to_string(unit) + ", " + std::to_string(fraction) + " changed, always " +
                     std::to_string(always));
        const Kind k = round_trip(l, old, now, always);
        if (fraction == 0.0) {
          EXPECT_EQ(k, Kind::kUnchanged);
        }
        if (fraction == 0.03) {
          EXPECT_NE(k, Kind::kDense);
        }
      }
    }
  }
}

// Bit patterns, not values: -0.0 against 0.0 and NaN payloads are changes.
TEST_P(CudaDeltaTest, SignedZerosAndNanPayloadsAreChanges) {
  const Layout l = make_layout(4, {4 * 4096});
  std::vector<float> a(4096, 1.0f), b = a;
  uint32_t nan1 = 0x7fc00001, nan2 = 0x7fc00002;
  a[10] = 0.0f;
  b[10] = -0.0f;
  std::memcpy(&a[2000], &nan1, 4);
  std::memcpy(&b[2000], &nan2, 4);
  std::vector<std::vector<uint8_t>> old(1), now(1);
  old[0].resize(4 * 4096);
  now[0].resize(4 * 4096);
  std::memcpy(old[0].data(), a.data(), old[0].size());
  std::memcpy(now[0].data(), b.data(), now[0].size());
  EXPECT_EQ(round_trip(l, old, now, false), Kind::kIndices);
}

// A streamed bucket is encoded in its own staging slot: `now` inside `out`.
TEST_P(CudaDeltaTest, EncodesInPlace) {
  const Layout l = make_layout(2, {2 * 10000, 2 * 300});
  std::vector<std::vector<uint8_t>> old, now;
  fill(l, 0.02, 7, old, now);
  std::vector<uint8_t> packed(l.bytes, 0);
  for (size_t i = 0; i < l.pieces.size(); ++i) std::memcpy(packed.data() + l.pieces[i].first, now[i].data(), now[i].size());
  uint8_t* slot = device_copy(packed);
  std::vector<Segment> ds;
  std::vector<uint8_t*> bases;
  for (size_t i = 0; i < l.pieces.size(); ++i) {
    bases.push_back(baseline_copy(old[i]));
    ds.push_back({slot + l.pieces[i].first, bases[i], l.pieces[i].first, l.pieces[i].second});
  }
  auto dev = codec_->encode(ds, l.bytes, 2, false, slot);
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  ASSERT_EQ(dev->kind, Kind::kIndices);
  std::vector<std::vector<uint8_t>> host_base = old;
  std::vector<Segment> hs;
  for (size_t i = 0; i < l.pieces.size(); ++i)
    hs.push_back({now[i].data(), host_base[i].data(), l.pieces[i].first, l.pieces[i].second});
  std::vector<uint8_t> host_out(l.bytes);
  auto host = host_codec()->encode(hs, l.bytes, 2, false, host_out.data());
  ASSERT_TRUE(host.ok());
  ASSERT_EQ(host->wire_bytes, dev->wire_bytes);
  EXPECT_EQ(download(slot, dev->wire_bytes), std::vector<uint8_t>(host_out.begin(), host_out.begin() + host->wire_bytes));
  mem_->release(slot);
  for (auto* p : bases) codec_->free_baseline(p);
}

// Hostile encodings: the device refuses what the host refuses, and writes nothing.
TEST_P(CudaDeltaTest, RefusesHostileEncodingsBeforeWriting) {
  const Layout l = make_layout(2, {2 * 1000, 2 * 1000});  // a gap between the pieces
  std::vector<std::vector<uint8_t>> old, now;
  fill(l, 0.01, 11, old, now);
  std::vector<std::vector<uint8_t>> host_base = old;
  std::vector<Segment> hs;
  for (size_t i = 0; i < 2; ++i) hs.push_back({now[i].data(), host_base[i].data(), l.pieces[i].first, l.pieces[i].second});
  std::vector<uint8_t> wire(l.bytes);
  auto h = host_codec()->encode(hs, l.bytes, 2, false, wire.data());
  ASSERT_TRUE(h.ok());
  ASSERT_EQ(h->kind, Kind::kIndices);
  auto check = [&](Header bad, std::vector<uint8_t> bytes, const std::string& why) {
    SCOPED_TRACE(why);
    std::vector<uint8_t*> dest;
    std::vector<Segment> ds, hs2;
    std::vector<std::vector<uint8_t>> hdest = old;
    for (size_t i = 0; i < 2; ++i) {
      dest.push_back(device_copy(old[i]));
      ds.push_back({nullptr, dest[i], l.pieces[i].first, l.pieces[i].second});
      hs2.push_back({nullptr, hdest[i].data(), l.pieces[i].first, l.pieces[i].second});
    }
    bytes.resize(std::max<size_t>(bytes.size(), l.bytes));
    uint8_t* dwire = device_copy(bytes);
    Status host_verdict = host_codec()->apply(bad, bytes.data(), l.bytes, hs2, "bucket 0 of v2");
    Status dev_verdict = codec_->apply(bad, dwire, l.bytes, ds, "bucket 0 of v2");
    EXPECT_EQ(host_verdict.code(), Code::kDataCorrupt) << host_verdict.to_string();
    EXPECT_EQ(dev_verdict.code(), Code::kDataCorrupt) << dev_verdict.to_string();
    for (size_t i = 0; i < 2; ++i) EXPECT_EQ(download(dest[i], old[i].size()), old[i]) << "nothing written";
    for (auto* p : dest) mem_->release(p);
    mem_->release(dwire);
  };
  const uint64_t values = h->changed * 2;
  {  // the last gap cut short: its final byte gets a continuation bit
    auto b = wire;
    b[h->wire_bytes - 1] |= 0x80;
    check(*h, b, "a gap cut short");
  }
  {  // the first gap six bytes or more long (the count of gaps still right)
    Header bad = *h;
    bad.wire_bytes += 5;
    auto b = wire;
    b.insert(b.begin() + static_cast<long>(values), {0x80, 0x80, 0x80, 0x80, 0x80});
    check(bad, b, "a gap too long");
  }
  {  // a gap that lands between the pieces (unit 1000 + ...: the alignment gap)
    auto b = wire;
    b[values] = 0xe8;  // 1000: first change at unit 1000, past piece 0 (units 0..999)
    b.insert(b.begin() + static_cast<long>(values) + 1, 0x07);
    Header bad = *h;
    bad.wire_bytes += 1;
    check(bad, b, "a change between the pieces");
  }
  {  // a bitmask marking a unit past the bucket
    Header bad = *h;
    bad.kind = Kind::kBitmask;
    const uint64_t units = l.bytes / 2;
    std::vector<uint8_t> b(values + (units + 7) / 8, 0);
    bad.wire_bytes = b.size();
    b[values] = 1;                                // unit 0, and the rest
    for (uint64_t c = 1; c < h->changed; ++c) b[values + c / 8] |= static_cast<uint8_t>(1u << (c % 8));
    b[b.size() - 1] |= 0x80;                      // a bit past the last unit
    check(bad, b, "a bitmask past the bucket");
  }
}

INSTANTIATE_TEST_SUITE_P(Baselines, CudaDeltaTest, ::testing::Values(DeltaBaseline::kDevice, DeltaBaseline::kHost),
                         [](const auto& info) { return info.param == DeltaBaseline::kDevice ? "device" : "pinned_host"; });

}  // namespace
}  // namespace paramcast::delta
