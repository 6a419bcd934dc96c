// WeightUpdateTest: one Publisher and several Subscribers in this process,
// on real ZeroMQ sockets and real Gloo TCP pairs; each subscriber lands
// weights in registered buffers or through a copying callback. Shared by the
// weight_update and streamed-update suites.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "tests/support/cluster.h"

namespace paramcast::test {

// A subscriber with either registered destinations or a copying callback.
struct Worker {
  std::unique_ptr<Subscriber> sub;
  bool callback = false;
  std::vector<TensorSpec> specs;
  std::map<std::string, std::vector<uint8_t>> dest;      // registered
  std::mutex mu;
  std::map<std::string, std::vector<uint8_t>> received;  // via callback
  std::map<std::string, std::pair<DType, std::vector<int64_t>>> seen_meta;
  std::vector<uint64_t> begun, ended;

  const std::vector<uint8_t>& bytes(const std::string& name) { return callback ? received[name] : dest[name]; }
};

class WeightUpdateTest : public ::testing::Test {
 protected:
  // Starts a publisher and `n` subscribers; subscriber i uses the callback when callback(i).
  void start(Config cfg, int n, const std::vector<TensorSpec>& registered, std::function<bool(int)> callback = {}) {
    cfg.publisher.subscriber_count = n;
    auto pub = Publisher::create(cfg);
    ASSERT_TRUE(pub.ok()) << pub.status().to_string();
    pub_ = std::move(pub.value());
    cfg.control.endpoint = pub_->endpoint();
    for (int i = 0; i < n; ++i) {
      auto w = std::make_unique<Worker>();
      auto s = Subscriber::create(cfg, "worker-" + std::to_string(i + 1));
      ASSERT_TRUE(s.ok());
      w->sub = std::move(s.value());
      w->callback = callback && callback(i);
      w->specs = registered;
      Worker* raw = w.get();
      if (w->callback) {
        w->sub->on_tensor([raw](const TensorView& v) {
          std::lock_guard<std::mutex> lock(raw->mu);
          const uint64_t n = v.spec.nbytes().value();
          raw->received[v.spec.name].assign(static_cast<const uint8_t*>(v.data), static_cast<const uint8_t*>(v.data) + n);
          raw->seen_meta[v.spec.name] = {v.spec.dtype, v.spec.shape};
          return Status();
        });
      } else {
        for (const auto& spec : registered) {
          auto& buf = w->dest[spec.name];
          buf.assign(spec.nbytes().value(), 0xEE);
          ASSERT_TRUE(w->sub->register_tensor(TensorView{spec, buf.data(), Device::cpu()}).ok());
        }
      }
      w->sub->on_update_begin([raw](uint64_t v) { raw->begun.push_back(v); });
      w->sub->on_update_end([this, raw, i](uint64_t v, const Status&) {
        raw->ended.push_back(v);
        return end_status_ ? end_status_(i, v) : Status();
      });
      ASSERT_TRUE(w->sub->start().ok());
      workers_.push_back(std::move(w));
    }
    Status s = pub_->start();
    ASSERT_TRUE(s.ok()) << s.to_string();
  }

  // Every worker holds exactly `t`'s bytes.
  void expect_holds(test::HostTensors& t, uint64_t version) {
    for (auto& w : workers_) {
      EXPECT_EQ(w->sub->state().kind, WeightStateKind::kConsistent);
      EXPECT_EQ(w->sub->state().version, version);
      // Under the lock the callback writes under: a later update may hand
      // over tensors without any data-plane traffic (an unchanged delta
      // bucket), and the test must not read them unsynchronised.
      std::lock_guard<std::mutex> lock(w->mu);
      for (size_t i = 0; i < t.specs.size(); ++i)
        ASSERT_TRUE(w->bytes(t.specs[i].name) == t.bytes[i])
            << "tensor '" << t.specs[i].name << "' (" << t.bytes[i].size() << " B) differs in a "
            << (w->callback ? "callback" : "registered") << " worker at v" << version;
    }
  }

  // Publishes `t` at version `v` and checks that every worker holds it.
  void publish_and_check(test::HostTensors& t, uint64_t v) {
    t.fill(v);
    UpdateResult r = pub_->weight_update(t.views());
    ASSERT_TRUE(r.ok()) << r.status.to_string();
    expect_holds(t, v);
  }

  void TearDown() override {
    for (auto& w : workers_) w->sub->stop();
    if (pub_) pub_->shutdown();
  }

  std::unique_ptr<Publisher> pub_;
  std::vector<std::unique_ptr<Worker>> workers_;
  // What worker i's on_update_end hook returns for version v (set before start()).
  std::function<Status(int, uint64_t)> end_status_;
};

}  // namespace paramcast::test
