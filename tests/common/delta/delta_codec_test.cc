// The delta codec on its own: every encoding round-trips bit for bit, the
// baseline moves to the new bytes, and hostile wire bytes are refused
// before anything is written.
#include "common/delta/delta_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

namespace paramcast::delta {
namespace {

// Two pieces with an alignment gap between them, as a packed bucket has.
struct Bucket {
  std::vector<uint8_t> a_now, a_base, b_now, b_base;
  uint64_t b_offset = 0;
  uint64_t bytes = 0;

  Bucket(size_t a_bytes, size_t b_bytes) {
    std::mt19937 rng(1);
    a_now.resize(a_bytes);
    for (auto& x : a_now) x = static_cast<uint8_t>(rng());
    b_now.resize(b_bytes);
    for (auto& x : b_now) x = static_cast<uint8_t>(rng());
    a_base = a_now;
    b_base = b_now;
    b_offset = (a_bytes + 255) / 256 * 256;
    bytes = b_offset + b_bytes;
  }
  std::vector<Segment> encoder() { return {{a_now.data(), a_base.data(), 0, a_now.size()}, {b_now.data(), b_base.data(), b_offset, b_now.size()}}; }
  static std::vector<Segment> decoder(std::vector<uint8_t>& a, std::vector<uint8_t>& b, uint64_t b_offset) {
    return {{nullptr, a.data(), 0, a.size()}, {nullptr, b.data(), b_offset, b.size()}};
  }
  void change(double fraction, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> coin(0, 1);
    for (auto* v : {&a_now, &b_now})
      for (size_t i = 0; i < v->size(); i += 2)
        if (coin(rng) < fraction) (*v)[i] ^= 0x5a;
  }
};

// Encodes, checks the baseline moved, and applies onto an engine's old copy.
void round_trip(Bucket& bk, double fraction, bool always, Kind want) {
  auto old_a = bk.a_base, old_b = bk.b_base;
  bk.change(fraction, 7);
  std::vector<uint8_t> out(bk.bytes), mask;
  Header h = encode(bk.encoder(), bk.bytes, 2, always, out.data(), mask);
  EXPECT_EQ(h.kind, want) << kind_name(h.kind);
  EXPECT_EQ(bk.a_base, bk.a_now);
  EXPECT_EQ(bk.b_base, bk.b_now);
  ASSERT_EQ(h.piece_hashes.size(), 2u);
  if (h.kind == Kind::kDense) {
    EXPECT_EQ(h.wire_bytes, bk.bytes);
    EXPECT_EQ(0, std::memcmp(out.data(), bk.a_now.data(), bk.a_now.size()));
    EXPECT_EQ(0, std::memcmp(out.data() + bk.b_offset, bk.b_now.data(), bk.b_now.size()));
    return;
  }
  Status s = apply(h, out.data(), bk.bytes, Bucket::decoder(old_a, old_b, bk.b_offset), "bucket 0");
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(old_a, bk.a_now);
  EXPECT_EQ(old_b, bk.b_now);
}

TEST(DeltaCodecTest, EachEncodingRoundTripsAndTheSmallestWins) {
  Bucket few(100000, 60000);
  round_trip(few, 0.002, false, Kind::kIndices);  // sparse: gaps beat the bitmask
  Bucket many(100000, 60000);
  round_trip(many, 0.30, false, Kind::kBitmask);  // dense-ish: the bitmask wins, under half
  Bucket most(100000, 60000);
  round_trip(most, 0.80, false, Kind::kDense);  // more than half: dense
  Bucket most_always(100000, 60000);
  round_trip(most_always, 0.60, true, Kind::kBitmask);  // `always`: a delta while smaller than dense
  Bucket none(1000, 1000);
  round_trip(none, 0.0, false, Kind::kUnchanged);
}

TEST(DeltaCodecTest, BitPatternsNotValues) {
  std::vector<float> now = {0.0f, std::nanf("1"), 1.0f}, base = {-0.0f, std::nanf("2"), 1.0f};
  std::vector<uint8_t> out(12), mask;
  std::vector<Segment> seg = {{reinterpret_cast<uint8_t*>(now.data()), reinterpret_cast<uint8_t*>(base.data()), 0, 12}};
  Header h = encode(seg, 12, 4, true, out.data(), mask);
  EXPECT_EQ(h.changed, 2u) << "0.0 vs -0.0 and two NaN payloads are changes";
  EXPECT_EQ(0, std::memcmp(now.data(), base.data(), 12));
}

TEST(DeltaCodecTest, HostileEncodingsAreRefusedBeforeAnyByteIsWritten) {
  Bucket bk(4000, 4096);  // tensor b starts at 4096: bytes 4000..4095 are an alignment gap
  auto old_a = bk.a_base, old_b = bk.b_base;
  bk.change(0.01, 3);
  std::vector<uint8_t> out(bk.bytes), mask;
  Header h = encode(bk.encoder(), bk.bytes, 2, false, out.data(), mask);
  ASSERT_EQ(h.kind, Kind::kIndices);
  auto expect_refused = [&](Header bad, std::vector<uint8_t> wire, const std::string& says) {
    auto a = old_a, b = old_b;
    Status s = apply(bad, wire.data(), bk.bytes, Bucket::decoder(a, b, bk.b_offset), "bucket 3 of v9");
    EXPECT_EQ(s.code(), Code::kDataCorrupt) << s.to_string();
    EXPECT_NE(s.message().find(says), std::string::npos) << s.to_string();
    EXPECT_EQ(a, old_a) << "nothing may be written";
    EXPECT_EQ(b, old_b);
  };
  // A gap that jumps past the bucket.
  std::vector<uint8_t> wire(out.begin(), out.begin() + h.wire_bytes);
  Header past = h;
  std::vector<uint8_t> far = wire;
  far.resize(h.changed * 2);
  for (uint64_t k = 0; k < h.changed; ++k) far.push_back(k + 1 == h.changed ? 0x7f : 0);
  far.back() = 0xff;
  far.push_back(0x7f);  // the last gap: two bytes, 16383 units
  past.wire_bytes = far.size();
  expect_refused(past, far, "lies past the bucket");
  // Bytes left over after the last change.
  Header longer = h;
  auto extra = wire;
  extra.push_back(0);
  longer.wire_bytes = extra.size();
  expect_refused(longer, extra, "left after its");
  // A change inside the alignment gap between the two tensors.
  Header gap = h;
  gap.changed = 1;
  std::vector<uint8_t> one = {0xAA, 0xBB};
  for (uint64_t g = 2010; ; g >>= 7) {  // unit 2010: bytes 4020..4021, in the gap
    one.push_back(static_cast<uint8_t>((g & 0x7f) | (g >= 0x80 ? 0x80 : 0)));
    if (g < 0x80) break;
  }
  gap.wire_bytes = one.size();
  expect_refused(gap, one, "lies between the bucket's tensors");
  // Sizes that cannot be.
  Header wrong = h;
  wrong.wire_bytes = 3;
  expect_refused(wrong, wire, "cannot carry");
  Header hashes = h;
  hashes.piece_hashes.pop_back();
  expect_refused(hashes, wire, "piece hashes for 2 pieces");
  Header unit = h;
  unit.unit = 3;
  expect_refused(unit, wire, "unit 3");
  // A bitmask that marks more units than its header says.
  Bucket dense(4096, 4096);
  auto da = dense.a_base, db = dense.b_base;
  dense.change(0.3, 4);
  std::vector<uint8_t> dout(dense.bytes);
  Header bm = encode(dense.encoder(), dense.bytes, 2, false, dout.data(), mask);
  ASSERT_EQ(bm.kind, Kind::kBitmask);
  bm.changed -= 1;
  bm.wire_bytes -= 2;
  std::vector<uint8_t> bwire(dout.begin() + 2, dout.begin() + 2 + bm.wire_bytes);
  Status s = apply(bm, bwire.data(), dense.bytes, Bucket::decoder(da, db, dense.b_offset), "bucket 1");
  EXPECT_EQ(s.code(), Code::kDataCorrupt) << s.to_string();
}

// A piece that is not whole units (a layout a peer sent) is refused before
// a byte is written, and the encoder sends such a bucket dense.
TEST(DeltaCodecTest, PiecesThatAreNotWholeUnitsAreRefused) {
  std::vector<uint8_t> now(8, 1), base(8, 0), out(8), mask;
  std::vector<Segment> odd = {{now.data() + 2, base.data() + 2, 0, 6}};
  Header h = encode(odd, 8, 4, true, out.data(), mask);
  EXPECT_EQ(h.kind, Kind::kDense);
  Header bad;
  bad.kind = Kind::kIndices;
  bad.unit = 4;
  bad.changed = 1;
  bad.wire_bytes = 5;
  bad.piece_hashes = {0};
  std::vector<uint8_t> wire = {9, 9, 9, 9, 1};  // one change at unit 1: bytes 4..7 of a 6-byte piece
  std::vector<uint8_t> dst(6, 0);
  Status s = apply(bad, wire.data(), 8, {{nullptr, dst.data(), 0, 6}}, "bucket 0");
  EXPECT_EQ(s.code(), Code::kDataCorrupt) << s.to_string();
  EXPECT_NE(s.message().find("not whole units of 4"), std::string::npos) << s.to_string();
  EXPECT_EQ(dst, std::vector<uint8_t>(6, 0));
}

}  // namespace
}  // namespace paramcast::delta
