// The shm segment's hand-over (common/data/shm/segment.h) on a real abstract
// Unix socket: each reader presents its own secret, and a holder of one
// reader's secret cannot attach as another rank.
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "common/data/shm/segment.h"

namespace paramcast::shm_backend {
namespace {

using std::chrono::milliseconds;

std::string secret() {
  auto b = Bootstrap::parse(Bootstrap::mint().value()).value();
  return b.secret;
}

TEST(ShmSegmentTest, EachReaderAttachesWithItsOwnSecretOnlyAsItsOwnRank) {
  const Bootstrap b = Bootstrap::parse(Bootstrap::mint().value()).value();
  const std::vector<std::string> secrets = {"", secret(), secret()};
  std::vector<int> missing;
  auto root = std::async(std::launch::async, [&] {
    return Segment::host(b, 3, 4096, true, milliseconds(20000), {"publisher", "worker-1", "worker-2"}, {}, secrets,
                         &missing);
  });
  auto as = [&](const std::string& s, int rank, milliseconds timeout) {
    return Segment::attach(Bootstrap::parse(b.with_secret(s)).value(), rank, 3, timeout);
  };
  // worker-1, holding its own secret, tries to take worker-2's place: refused.
  auto impostor = as(secrets[1], 2, milliseconds(1500));
  EXPECT_FALSE(impostor.ok());
  EXPECT_NE(impostor.status().message().find("a wrong secret or rank"), std::string::npos)
      << impostor.status().to_string();
  // The group's bootstrap secret (what every reader used to share) is not a reader's either.
  EXPECT_FALSE(as(b.secret, 1, milliseconds(1000)).ok());
  auto one = as(secrets[1], 1, milliseconds(10000));
  auto two = as(secrets[2], 2, milliseconds(10000));
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  auto hosted = root.get();
  ASSERT_TRUE(hosted.ok()) << hosted.status().to_string();
  EXPECT_TRUE(missing.empty());
}

TEST(ShmSegmentTest, TheRootNamesTheRanksThatNeverAttached) {
  const Bootstrap b = Bootstrap::parse(Bootstrap::mint().value()).value();
  const std::vector<std::string> secrets = {"", secret(), secret()};
  std::vector<int> missing;
  auto root = std::async(std::launch::async, [&] {
    return Segment::host(b, 3, 4096, true, milliseconds(1500), {"publisher", "worker-1", "worker-2"}, {}, secrets,
                         &missing);
  });
  auto one = Segment::attach(Bootstrap::parse(b.with_secret(secrets[1])).value(), 1, 3, milliseconds(10000));
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  auto hosted = root.get();
  ASSERT_FALSE(hosted.ok());
  EXPECT_NE(hosted.status().message().find("worker-2 did not attach"), std::string::npos) << hosted.status().to_string();
  EXPECT_EQ(missing, std::vector<int>{2});
}

}  // namespace
}  // namespace paramcast::shm_backend
