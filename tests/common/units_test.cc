#include "common/units.h"

#include <gtest/gtest.h>

namespace paramcast {
namespace {
using namespace std::chrono;

TEST(UnitsTest, Durations) {
  EXPECT_EQ(parse_duration("500ms"), nanoseconds(milliseconds(500)));
  EXPECT_EQ(parse_duration("10s"), nanoseconds(seconds(10)));
  EXPECT_EQ(parse_duration("2m"), nanoseconds(minutes(2)));
  EXPECT_EQ(parse_duration("1.5s"), nanoseconds(milliseconds(1500)));
  EXPECT_EQ(parse_duration("250us"), nanoseconds(microseconds(250)));
  EXPECT_FALSE(parse_duration("10"));
  EXPECT_FALSE(parse_duration("s"));
  EXPECT_FALSE(parse_duration("10 years"));
  EXPECT_FALSE(parse_duration("-1s"));
}

TEST(UnitsTest, Sizes) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("256MiB"), 256ull << 20);
  EXPECT_EQ(parse_size("1GiB"), 1ull << 30);
  EXPECT_EQ(parse_size("1.5KiB"), 1536u);
  EXPECT_EQ(parse_size("1GB"), 1000000000u);
  EXPECT_FALSE(parse_size("1.5"));
  EXPECT_FALSE(parse_size("12 parsecs"));
  EXPECT_FALSE(parse_size("99999999TiB"));
}

TEST(UnitsTest, Formatting) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(3ull << 29), "1.50 GiB");
  // Rates: decimal, GB/s from 1 GB/s up, MB/s below.
  EXPECT_EQ(format_rate(2.345e9), "2.35 GB/s");
  EXPECT_EQ(format_rate(248.74e6), "248.74 MB/s");
  EXPECT_EQ(format_rate(1048576), "1.05 MB/s");
  EXPECT_EQ(format_rate(0), "0.00 MB/s");
  EXPECT_EQ(format_duration(milliseconds(1500)), "1.500 s");
}

}  // namespace
}  // namespace paramcast
