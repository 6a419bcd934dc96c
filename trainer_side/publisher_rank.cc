// PublisherRank: trainer rank r > 0 of a many-sender job. A member of rank
// 0's group built from the inference side's member machinery (control
// client, group member, data thread: SubscriberImpl with `source`), which
// holds shards instead of registered buffers and sends them in sharded
// plans (inference_side/subscriber_sharded.cc).
#include <thread>

#include "common/log.h"
#include "common/units.h"
#include "inference_side/subscriber_impl.h"
#include "trainer_side/publisher.h"

namespace paramcast {

PublisherRank::PublisherRank(std::unique_ptr<SubscriberImpl> impl, std::string id, const Config& config)
    : impl_(std::move(impl)),
      id_(std::move(id)),
      endpoint_(config.control.endpoint),
      bound_(config.publisher.update_timeout + config.control.heartbeat_timeout),
      join_timeout_(config.control.join_timeout),
      rules_(config.publisher.transforms) {}

PublisherRank::~PublisherRank() { stop(); }

StatusOr<std::unique_ptr<PublisherRank>> PublisherRank::create(const Config& config, int rank) {
  if (rank < 1 || rank >= config.publisher.ranks)
    return invalid_argument("trainer rank " + std::to_string(rank) + " is not among ranks 1.." +
                            std::to_string(config.publisher.ranks - 1) + " (publisher.ranks: " +
                            std::to_string(config.publisher.ranks) + "; rank 0 runs the Publisher)");
  const std::string id = trainer_rank_id(rank);
  return std::unique_ptr<PublisherRank>(
      new PublisherRank(std::make_unique<SubscriberImpl>(config, id, true), id, config));
}

Status PublisherRank::start() { return impl_->start(); }

uint64_t PublisherRank::baseline_bytes() const { return impl_->sent_baseline_bytes(); }

void PublisherRank::stop() {
  stopped_ = true;
  if (impl_) impl_->stop();
}

UpdateResult PublisherRank::weight_update(const std::vector<ShardView>& shards, std::optional<uint64_t> step,
                                          void* after_stream) {
  UpdateResult r;
  r.tensors = shards.size();
  if (!step) ++calls_;  // counted on entry, whatever becomes of the call, as rank 0 counts
  const auto t0 = Clock::now();
  while (impl_->next_report(Millis(0))) {
  }  // reports of updates no call waited for
  // The first call may come before rank 0 welcomed this rank (every rank
  // starts at once): it waits for that within control.join_timeout.
  while (!impl_->joined() && !stopped_ && Clock::now() < t0 + join_timeout_) std::this_thread::sleep_for(Millis(10));
  if (!impl_->joined()) {
    r.status = unavailable(id_ + " has not joined the publisher at " + endpoint_ + " within control.join_timeout (" +
                           format_duration(join_timeout_) + ")");
    return r;
  }
  // What travels (publisher.transforms): this rank transforms what it holds,
  // held until the call returns; a shard the rules cannot apply to refuses
  // this rank's part, and rank 0 the update, at once.
  transform::TransformedShards wire;
  if (!rules_.empty()) {
    auto t = transform::apply_shards(shards, rules_);
    if (!t.ok()) {
      r.status = impl_->publish_refused(t.status(), step ? *step : calls_);
      r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      return r;
    }
    wire = std::move(t.value());
    r.transformed = wire.transformed;
  }
  if (Status s = impl_->publish(rules_.empty() ? shards : wire.views, step ? *step : calls_, after_stream); !s.ok()) {
    r.status = s;
    return r;
  }
  const uint64_t seq = impl_->publish_seq();
  bool ran = false;
  for (;;) {
    auto report = impl_->next_report(std::chrono::duration_cast<Millis>(t0 + bound_ - Clock::now()));
    if (!report) {
      r.status = timeout_error(id_ + ": no update took its part within publisher.update_timeout + heartbeat_timeout (" +
                               format_duration(bound_) + ")");
      break;
    }
    if (report->version && report->version <= last_version_) continue;
    // A plan of an earlier call of this rank (one that ended before its
    // Commit came) is not this call's update: this call waits for its own.
    if (const uint64_t of = report->version ? impl_->call_of(report->version) : 0; of && of != seq) continue;
    r.version = report->version;
    r.status = report->status;
    r.bytes = report->bytes;
    if (report->version) last_version_ = report->version;
    ran = true;
    break;
  }
  // Its shards are the caller's again: no later plan may use them.
  impl_->end_publish(seq, ran);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

}  // namespace paramcast
