// metrics.listen end to end in C++ (so that the sanitizer builds run it too):
// a publisher and its engines serve their pages while updates run, scraped
// by a real HTTP client from another thread; the figures follow the updates,
// and shutting down never waits on a scraper.
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "common/synthetic_model.h"
#include "tests/support/cluster.h"
#include "tests/support/update_fixture.h"

namespace paramcast {
namespace {

using test::WeightUpdateTest;
using MetricsTest = WeightUpdateTest;

// host, port of http://HOST:PORT/metrics
std::pair<std::string, int> host_port(const std::string& url) {
  const std::string scheme = "http://", path = "/metrics";
  EXPECT_EQ(url.rfind(scheme, 0), 0u) << url;
  const size_t colon = url.rfind(':'), slash = url.rfind(path);
  EXPECT_TRUE(colon != std::string::npos && slash != std::string::npos && slash > colon) << url;
  return {url.substr(scheme.size(), colon - scheme.size()), std::stoi(url.substr(colon + 1, slash - colon - 1))};
}

std::string scrape(const std::string& url) {
  auto [host, port] = host_port(url);
  httplib::Client c(host, port);
  c.set_read_timeout(std::chrono::seconds(20));
  auto r = c.Get("/metrics");
  if (!r || r->status != 200) return "";
  return r->body;
}

// The value of the sample line `name` (with its labels, as printed), or -1.
double sample(const std::string& page, const std::string& name) {
  const size_t at = page.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(page.substr(at + name.size() + 2));
}

TEST_F(MetricsTest, PagesFollowUpdatesWhileScrapedFromAnotherThread) {
  Config cfg = test::test_config(2);
  cfg.metrics.listen_host = "127.0.0.1";
  cfg.metrics.listen_port = 0;
  auto specs = synthetic_llm_layout(1 << 20, 4, DType::kBF16);
  start(cfg, 2, specs);
  const std::string pub_url = pub_->metrics_endpoint();
  const std::string sub_url = workers_[0]->sub->metrics_endpoint();
  ASSERT_FALSE(pub_url.empty());
  ASSERT_FALSE(sub_url.empty());
  ASSERT_NE(pub_url, sub_url);

  std::atomic<bool> stop{false};
  std::atomic<int> pages{0}, bad{0};
  std::thread scraper([&] {
    while (!stop) {
      const std::string a = scrape(pub_url), b = scrape(sub_url);
      if (a.find("# TYPE paramcast_updates_total counter") == std::string::npos ||
          b.find("paramcast_subscriber_version{worker=\"worker-1\"}") == std::string::npos)
        ++bad;
      ++pages;
    }
  });
  auto t = test::make_tensors(specs);
  for (uint64_t v = 1; v <= 5; ++v) publish_and_check(t, v);
  stop = true;
  scraper.join();
  EXPECT_GT(pages.load(), 0);
  EXPECT_EQ(bad.load(), 0);

  const std::string page = scrape(pub_url);
  EXPECT_EQ(sample(page, "paramcast_updates_total{result=\"ok\"}"), 5) << page;
  EXPECT_EQ(sample(page, "paramcast_published_version"), 5) << page;
  EXPECT_EQ(sample(page, "paramcast_member_version{worker=\"worker-2\"}"), 5) << page;
  EXPECT_EQ(sample(page, "paramcast_members{state=\"consistent\"}"), 2) << page;
  const std::string mine = scrape(sub_url);
  EXPECT_EQ(sample(mine, "paramcast_subscriber_version{worker=\"worker-1\"}"), 5) << mine;
  EXPECT_EQ(sample(mine, "paramcast_subscriber_updates_total{worker=\"worker-1\",result=\"ok\"}"), 5) << mine;
}

TEST_F(MetricsTest, ShutdownDoesNotWaitOnAClientHoldingAConnection) {
  Config cfg = test::test_config(1);
  cfg.metrics.listen_host = "127.0.0.1";
  cfg.metrics.listen_port = 0;
  start(cfg, 1, synthetic_llm_layout(64 << 10, 1, DType::kBF16));
  auto [host, port] = host_port(pub_->metrics_endpoint());
  // Three connections that send half a request and then nothing.
  std::vector<int> fds;
  for (int i = 0; i < 3; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    const char half[] = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
    ASSERT_GT(::send(fd, half, sizeof half - 1, 0), 0);
    fds.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  pub_->shutdown();
  const auto took = std::chrono::steady_clock::now() - t0;
  for (int fd : fds) ::close(fd);
  EXPECT_LT(took, std::chrono::seconds(15)) << "shutdown waited on the scrapers";
}

}  // namespace
}  // namespace paramcast
