#include "common/control/codec.h"

#include <gtest/gtest.h>

#include "common/control/messages.h"

namespace paramcast::control {
namespace {

TEST(CodecTest, RoundTrip) {
  auto frame = make_message(5, 77, [](auto b) {
    auto h = b.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setWorkerId("worker-3");
  });
  auto d = decode(frame.data(), frame.size(), DecodeLimits{});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  auto env = d.value()->envelope();
  EXPECT_EQ(env.getEpoch(), 5u);
  EXPECT_EQ(env.getIncarnation(), 77u);
  ASSERT_EQ(env.getBody().which(), proto::Envelope::Body::HELLO);
  EXPECT_STREQ(env.getBody().getHello().getWorkerId().cStr(), "worker-3");
  EXPECT_STREQ(body_name(env), "hello");
}

TEST(CodecTest, MalformedFramesAreProtocolErrors) {
  auto frame = make_message(1, 1, [](auto b) { b.initHeartbeat().setWeightVersion(3); });
  std::string bytes(static_cast<const char*>(frame.data()), frame.size());
  // Truncated.
  auto t = decode(bytes.data(), bytes.size() - 8, DecodeLimits{});
  EXPECT_FALSE(t.ok());
  // Not a whole number of words.
  auto odd = decode(bytes.data(), bytes.size() - 3, DecodeLimits{});
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().code(), Code::kProtocol);
  // Garbage.
  std::string garbage(64, '\xff');
  EXPECT_FALSE(decode(garbage.data(), garbage.size(), DecodeLimits{}).ok());
  // Empty.
  EXPECT_FALSE(decode(bytes.data(), 0, DecodeLimits{}).ok());
  // Oversized.
  DecodeLimits small;
  small.max_bytes = 16;
  auto big = decode(bytes.data(), bytes.size(), small);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("exceeds max_message_size"), std::string::npos);
}

}  // namespace
}  // namespace paramcast::control
