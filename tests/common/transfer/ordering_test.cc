// The ordering and error-path logic of the transfer pipeline, on the real
// host path: two ranks as threads of this process over real Gloo, with the
// DeviceMemory and Communicator wrapped (as leveldb's EnvWrapper) to record
// the calls the pipeline makes. On CUDA those calls are the stream
// dependencies (tests/gpu checks them on a device): packing and broadcasts
// wait for the caller's stream, a broadcast waits for its packing, the
// receiver's destinations are complete when receive() returns, and no
// buffer is released while a broadcast into it is in flight.
#include <gtest/gtest.h>

#include <algorithm>
#include <future>
#include <mutex>
#include <thread>

#include "common/data/communicator.h"
#include "common/data/device_memory.h"
#include "common/data/file_store.h"
#include "common/transfer/bucket_receiver.h"
#include "common/transfer/bucket_sender.h"
#include "tests/support/process.h"

namespace paramcast {
namespace {

void* const kCallerStream = reinterpret_cast<void*>(0x5);
void* const kCopyStream = reinterpret_cast<void*>(0xc0);

struct Log {
  std::mutex mu;
  std::vector<std::string> lines;
  void add(std::string s) {
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back(std::move(s));
  }
  std::string name(void* stream) { return stream == kCallerStream ? "caller" : stream == kCopyStream ? "copy" : "?"; }
  size_t find(const std::string& s, size_t from = 0) {
    for (size_t i = from; i < lines.size(); ++i)
      if (lines[i] == s) return i;
    return std::string::npos;
  }
};

// Real host memory that reports a copy stream and records the calls.
class RecordingMemory : public DeviceMemory {
 public:
  explicit RecordingMemory(Log& log) : log_(log), real_(std::move(create_device_memory(Device::cpu()).value())) {}
  StatusOr<void*> allocate(size_t bytes) override { return real_->allocate(bytes); }
  void release(void* ptr) override {
    log_.add("release");
    real_->release(ptr);
  }
  Status copy(void* dst, const void* src, size_t bytes) override { return real_->copy(dst, src, bytes); }
  Status copy_many(const std::vector<CopyOp>& ops) override {
    log_.add("copy_many");
    return real_->copy_many(ops);
  }
  Status synchronize() override {
    log_.add("synchronize");
    return real_->synchronize();
  }
  StatusOr<uint64_t> checksum(const void* ptr, size_t bytes, Checksum kind) override {
    return real_->checksum(ptr, bytes, kind);
  }
  Status checksum_start(int slot, const void* ptr, size_t bytes, Checksum kind) override {
    log_.add("checksum_start");
    return real_->checksum_start(slot, ptr, bytes, kind);
  }
  StatusOr<uint64_t> checksum_result(int slot) override {
    log_.add("checksum_result");
    return real_->checksum_result(slot);
  }
  Status order_after(void* stream) override {
    log_.add("mem.order_after(" + log_.name(stream) + ")");
    return Status();
  }
  void* stream() const override { return kCopyStream; }

 private:
  Log& log_;
  std::unique_ptr<DeviceMemory> real_;
};

// A real Gloo communicator whose calls and waits are recorded.
class RecordingComm : public Communicator {
 public:
  RecordingComm(Log& log, std::unique_ptr<Communicator> real) : log_(log), real_(std::move(real)) {}
  std::shared_ptr<Work> broadcast(void* data, size_t bytes, int root) override {
    const int k = issued_++;
    log_.add("broadcast " + std::to_string(k));
    return std::make_shared<RecordedWork>(log_, k, real_->broadcast(data, bytes, root));
  }
  Status order_after(void* stream) override {
    log_.add("comm.order_after(" + log_.name(stream) + ")");
    return Status();
  }
  void abort(const std::string& reason) override { real_->abort(reason); }
  Status async_error() override { return real_->async_error(); }
  int rank() const override { return real_->rank(); }
  int world_size() const override { return real_->world_size(); }
  Device device() const override { return real_->device(); }

 private:
  struct RecordedWork : Work {
    RecordedWork(Log& l, int k, std::shared_ptr<Work> w) : log(l), index(k), real(std::move(w)) {}
    Status wait(Deadline d) override {
      Status s = real->wait(d);
      log.add("waited " + std::to_string(index));
      return s;
    }
    Log& log;
    int index;
    std::shared_ptr<Work> real;
  };
  Log& log_;
  std::unique_ptr<Communicator> real_;
  int issued_ = 0;
};

class OrderingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("paramcast-order");
    auto bootstrap = mint_bootstrap(Backend::kGloo, 1);
    ASSERT_TRUE(bootstrap.ok());
    std::vector<std::future<StatusOr<std::unique_ptr<Communicator>>>> f;
    for (int r = 0; r < 2; ++r)
      f.push_back(std::async(std::launch::async, [this, r, b = *bootstrap] {
        GroupOptions o;
        o.epoch = 1;
        o.rank = r;
        o.world_size = 2;
        o.bootstrap = b;
        o.init_timeout = std::chrono::seconds(60);
        o.op_timeout = std::chrono::seconds(60);
        FileStore store(dir_);
        return create_communicator(o, store);
      }));
    for (int r = 0; r < 2; ++r) {
      auto c = f[r].get();
      ASSERT_TRUE(c.ok()) << c.status().to_string();
      comm_[r] = std::make_unique<RecordingComm>(log_[r], std::move(c.value()));
    }
  }
  void TearDown() override { test::remove_tree(dir_); }

  // Specs: a tensor split in direct chunks, then small packed ones.
  UpdatePlan plan(Checksum checksum) {
    std::vector<TensorSpec> specs = {{"big", DType::kU8, {3 * 4096}}};
    for (int i = 0; i < 12; ++i) specs.push_back({"small." + std::to_string(i), DType::kU8, {700}});
    DataPlaneOptions o;
    o.bucket_bytes = 4096;
    o.direct_min_bytes = 2048;
    o.checksum = checksum;
    return build_plan(1, specs, o).value();
  }

  std::string dir_;
  Log log_[2];
  std::unique_ptr<RecordingComm> comm_[2];
};

TEST_F(OrderingTest, PackingAndBroadcastsWaitForTheCallerAndTheirPacking) {
  UpdatePlan p = plan(Checksum::kXxh64Blocks);
  std::vector<std::vector<uint8_t>> src(p.tensors.size()), dst(p.tensors.size());
  std::vector<TensorView> views(p.tensors.size());
  std::vector<TensorView> dest_views(p.tensors.size());
  std::vector<const TensorView*> dest(p.tensors.size());
  for (size_t t = 0; t < p.tensors.size(); ++t) {
    src[t].resize(p.nbytes[t]);
    for (size_t i = 0; i < src[t].size(); ++i) src[t][i] = static_cast<uint8_t>(i * 7 + t);
    dst[t].assign(p.nbytes[t], 0);
    views[t] = TensorView{p.tensors[t], src[t].data(), Device::cpu()};
    dest_views[t] = TensorView{p.tensors[t], dst[t].data(), Device::cpu()};
    dest[t] = &dest_views[t];
  }
  RecordingMemory mem0(log_[0]), mem1(log_[1]);
  std::mutex sums_mu;
  std::map<size_t, uint64_t> sums;
  std::condition_variable sums_cv;
  auto sent = std::async(std::launch::async, [&] {
    transfer::BucketSender sender(&mem0);
    transfer::BucketSender::Hooks h;
    h.on_checksum = [&](size_t k, uint64_t v) {
      std::lock_guard<std::mutex> l(sums_mu);
      sums[k] = v;
      sums_cv.notify_all();
    };
    return sender.send(p, views, *comm_[0], h, Clock::now() + std::chrono::seconds(60), kCallerStream);
  });
  transfer::BucketReceiver receiver(&mem1, Device::cpu());
  transfer::BucketReceiver::Hooks h;
  h.expected_checksum = [&](size_t k) -> StatusOr<uint64_t> {
    std::unique_lock<std::mutex> l(sums_mu);
    sums_cv.wait(l, [&] { return sums.count(k) > 0; });
    return sums[k];
  };
  Status r = receiver.receive(p, dest, *comm_[1], h, Clock::now() + std::chrono::seconds(60));
  ASSERT_TRUE(r.ok()) << r.to_string();
  ASSERT_TRUE(sent.get().ok());
  for (size_t t = 0; t < p.tensors.size(); ++t) EXPECT_EQ(dst[t], src[t]) << p.tensors[t].name;

  // Sender: both streams wait for the caller before anything reads a tensor.
  auto& s = log_[0].lines;
  ASSERT_GE(s.size(), 2u);
  EXPECT_EQ(s[0], "mem.order_after(caller)");
  EXPECT_EQ(s[1], "comm.order_after(caller)");
  // Each bucket: [pack], broadcast waits for the copy stream, the checksum
  // is queued beside it, and taken after the broadcast was issued.
  size_t packs = 0;
  for (size_t k = 0; k < p.buckets.size(); ++k) {
    const size_t b = log_[0].find("broadcast " + std::to_string(k));
    ASSERT_NE(b, std::string::npos) << k;
    ASSERT_GE(b, 2u);
    EXPECT_EQ(s[b - 1], "checksum_start") << k;
    EXPECT_EQ(s[b - 2], "comm.order_after(copy)") << k;
    if (!p.buckets[k].direct) {
      EXPECT_EQ(s[b - 3], "copy_many") << k;
      ++packs;
    }
    EXPECT_EQ(s[b + 1], "checksum_result") << k;
  }
  EXPECT_GE(packs, 2u);
  // Receiver: a staging broadcast waits for the copy stream (the slot's last
  // unpack); the destinations are synchronised before receive() returns.
  auto& q = log_[1].lines;
  ASSERT_FALSE(q.empty());
  EXPECT_EQ(q.back(), "synchronize");
  for (size_t k = 0; k < p.buckets.size(); ++k) {
    const size_t b = log_[1].find("broadcast " + std::to_string(k));
    ASSERT_NE(b, std::string::npos);
    if (!p.buckets[k].direct) {
      EXPECT_EQ(q[b - 1], "comm.order_after(copy)") << k;
    }
  }
}

TEST_F(OrderingTest, FailingCallbackWaitsOutTheBucketInFlightBeforeReleasing) {
  UpdatePlan p = plan(Checksum::kNone);
  ASSERT_TRUE(p.buckets[0].direct && p.buckets[2].direct && !p.buckets[3].direct);
  std::vector<std::vector<uint8_t>> src(p.tensors.size());
  std::vector<TensorView> views(p.tensors.size());
  for (size_t t = 0; t < p.tensors.size(); ++t) {
    src[t].assign(p.nbytes[t], static_cast<uint8_t>(t));
    views[t] = TensorView{p.tensors[t], src[t].data(), Device::cpu()};
  }
  RecordingMemory mem0(log_[0]), mem1(log_[1]);
  auto sent = std::async(std::launch::async, [&] {
    transfer::BucketSender sender(&mem0);
    return sender.send(p, views, *comm_[0], {}, Clock::now() + std::chrono::seconds(60), nullptr);
  });
  Status r;
  {
    // No destinations: "big" is assembled from its three chunks, then handed
    // to the callback, which fails while bucket 3 is already in flight.
    transfer::BucketReceiver receiver(&mem1, Device::cpu());
    transfer::BucketReceiver::Hooks h;
    h.on_tensor = [](const TensorView& v) { return invalid_argument("engine refuses " + v.spec.name); };
    r = receiver.receive(p, std::vector<const TensorView*>(p.tensors.size(), nullptr), *comm_[1], h,
                        Clock::now() + std::chrono::seconds(60));
    log_[1].add("returned");
  }
  comm_[1]->abort("receiver failed");  // as the subscriber does
  (void)sent.get();                    // the root fails or finishes; either way it returns
  EXPECT_EQ(r.code(), Code::kInvalidArgument) << r.to_string();
  EXPECT_NE(r.message().find("tensor callback for 'big'"), std::string::npos) << r.to_string();
  const size_t issued = log_[1].find("broadcast 3");
  const size_t waited = log_[1].find("waited 3");
  const size_t returned = log_[1].find("returned");
  ASSERT_NE(issued, std::string::npos);
  ASSERT_NE(waited, std::string::npos) << "the bucket in flight was not waited out";
  EXPECT_LT(waited, returned);
  // The assembly buffer of "big" is released only after that wait.
  const size_t released = log_[1].find("release");
  ASSERT_NE(released, std::string::npos);
  EXPECT_GT(released, waited);
}

}  // namespace
}  // namespace paramcast
