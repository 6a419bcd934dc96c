// Streamed updates on the trainer's side: Publisher::begin_update and the
// Update handle, over the same protocol steps as weight_update (plan ->
// group -> check -> move -> applied), with the move driven by the caller's
// send()s (stream::StreamSender) instead of a list of tensors at hand.
#include <set>
#include <unordered_map>

#include "common/control/messages.h"
#include "common/log.h"
#include "common/plan_proto.h"
#include "trainer_side/publisher_impl.h"

namespace paramcast {

// One streamed update in progress: everything begin_stream set up, owned by
// the Update handle. The update lock is held for its whole life.
struct StreamState {
  std::unique_lock<UpdateGate> lock;
  Clock::time_point t0;
  UpdatePlan plan;
  UpdateResult r;
  std::unordered_map<std::string, uint32_t> index;  // tensor name -> manifest position
  std::vector<bool> sent;
  size_t sent_count = 0;
  bool moving = false;  // committed: the data plane is in use
  bool ended = false;
  Status status;        // the first failure
  PublisherImpl::MoveState move;
  std::unique_ptr<stream::StreamSender> sender;
  // Transforms (publisher.transforms or the update's): the manifest names
  // the caller's tensors; the plan what travels. Per transformed tensor, what
  // the caller sends (its spec) and what it becomes.
  std::vector<transform::Rule> rules;
  std::unordered_map<std::string, std::pair<TensorSpec, transform::Transform>> transforms;
  std::unordered_map<std::string, std::string> scales;  // scale tensor -> the tensor it belongs to
};

namespace {

// `st` refused before it took the update lock: `why` is its status.
std::unique_ptr<StreamState> refused(std::unique_ptr<StreamState> st, Status why) {
  st->status = st->r.status = std::move(why);
  return st;
}

// What travels for `manifest` (into `wire`): each tensor as the update's
// transforms make it, its scales beside it; st's transforms and scales noted.
Status lay_out_wire(const std::vector<TensorSpec>& manifest, StreamState& st, std::vector<TensorSpec>& wire) {
  wire.reserve(manifest.size());
  std::set<std::string> names;
  for (const auto& spec : manifest) names.insert(spec.name);
  for (const auto& spec : manifest) {
    auto how = transform::resolve(st.rules, spec);
    if (!how.ok()) return how.status();
    const auto specs = transform::wire_specs(spec, *how);
    if (!how->none()) {
      st.transforms[spec.name] = {spec, *how};
      ++st.r.transformed;
    }
    if (specs.size() > 1) {
      if (names.count(specs[1].name))
        return invalid_argument("tensor '" + spec.name + "': " + transform::describe(*how, st.rules) +
                                " sends its scales as '" + specs[1].name + "', which is also a tensor of this update");
      st.scales[specs[1].name] = spec.name;
    }
    wire.insert(wire.end(), specs.begin(), specs.end());
  }
  return Status();
}

// Each bucket's layout to the group as the stream lays it out.
std::function<void(size_t, const PlanBucket*, bool)> layout_hook(control::ControlServer& server, StreamState& st) {
  return [&server, s = &st](size_t k, const PlanBucket* bucket, bool end) {
    server.send_to(s->move.group, control::make_message(s->move.epoch, server.incarnation(), [&](auto b) {
                     auto l = b.initBucketLayouts();
                     l.setVersion(s->plan.version);
                     l.setFirst(static_cast<uint32_t>(k));
                     l.setEnd(end);
                     auto list = l.initBuckets(bucket ? 1 : 0);
                     if (bucket) bucket_to_proto(*bucket, list[0]);
                   }));
  };
}

}  // namespace

std::unique_ptr<StreamState> PublisherImpl::begin_stream(const std::vector<TensorSpec>& manifest,
                                                         const UpdateOptions& options) {
  auto st = std::make_unique<StreamState>();
  if (update_mu_.held_by_me()) {
    // This thread holds a streamed update open: waiting for it would never end.
    return refused(std::move(st), invalid_argument("begin_update: a streamed update is already open on this thread "
                                                   "(finish or abort it first)"));
  }
  if (cfg_.publisher.ranks > 1) {  // the other trainer ranks would wait for a plan naming their part
    return refused(std::move(st), invalid_argument("publisher.ranks is " + std::to_string(cfg_.publisher.ranks) +
                                                   ": every trainer rank publishes its part (weight_update_sharded on "
                                                   "rank 0, PublisherRank on the others)"));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (const std::string engine = slicing_engine_locked(); !engine.empty())  // a broadcast: they refuse it
      return refused(std::move(st), invalid_argument("begin_update: engine " + engine +
                                                     " serves slices of the weights (tensor parallelism): updates to "
                                                     "it go point to point, whole (weight_update), not streamed"));
  }
  st->lock = std::unique_lock<UpdateGate>(update_mu_);
  streaming_ = true;
  st->t0 = Clock::now();
  cap_ = st->t0 + cfg_.publisher.update_timeout;
  st->rules = options.transforms ? *options.transforms : cfg_.publisher.transforms;
  // Refused from here on: the update's version ends too (`reserved`: the plan took it).
  auto fail = [&](Status why, uint64_t version, bool reserved) {
    st->status = st->r.status = std::move(why);
    end_unplanned(version, reserved, st->status);
    return std::move(st);
  };
  if (!st->rules.empty() && cfg_.publisher.device.is_cuda())
    return fail(invalid_argument(std::string("UpdateOptions::transforms on publisher.device ") +
                                 cfg_.publisher.device.to_string() + ": " + transform::kCudaPending),
                options.version ? *options.version : next_version(), false);
  std::vector<TensorSpec> wire;
  if (Status s = lay_out_wire(manifest, *st, wire); !s.ok())
    return fail(s, options.version ? *options.version : next_version(), false);
  const size_t transformed = st->r.transformed;
  auto plan = make_plan(wire, options, true, st->r);  // 1. plan
  st->r.transformed = transformed;
  if (!plan.ok())
    return fail(plan.status(), st->r.version ? st->r.version : options.version ? *options.version : next_version(),
                false);
  st->plan = std::move(plan.value());
  for (uint32_t i = 0; i < st->plan.tensors.size(); ++i) st->index[st->plan.tensors[i].name] = i;
  st->sent.assign(st->plan.tensors.size(), false);
  if (Status s = ensure_group(); !s.ok()) return fail(s, st->plan.version, true);  // 2. group
  decide_delta(st->plan, st->r);
  if (!plan_round(st->plan, st->r)) return fail(st->r.status, st->plan.version, true);  // 3. check
  st->moving = true;  // 4. move, as the caller sends
  st->move = start_move();
  stream::StreamSender::Hooks hooks;
  hooks.on_checksum = checksum_hook(st->plan, st->move);
  hooks.on_progress = progress_hook(st->plan, st->move);
  if (baseline_fresh_) {
    hooks.baseline = &baseline_;
    hooks.codec = codec_.get();
    hooks.delta_always = cfg_.publisher.delta == DeltaMode::kAlways;
    hooks.on_delta = delta_hook(st->plan, st->move);
  }
  hooks.on_layout = layout_hook(server_, *st);
  st->sender = std::make_unique<stream::StreamSender>(mem_.get(), &sender_->staging());
  if (Status s = st->sender->begin(&st->plan, comm_.get(), std::move(hooks), cap_, cfg_.data_plane.direct_min_bytes);
      !s.ok())
    st->status = end_move(st->plan, st->move, s);
  return st;
}

namespace {
// A streamed tensor against what the update's manifest said of it.
Status spec_mismatch(const std::string& v, const TensorSpec& got, const TensorSpec& want) {
  if (got.dtype != want.dtype)
    return invalid_argument(v + "tensor '" + got.name + "': dtype expected " + std::string(dtype_name(want.dtype)) +
                            ", got " + std::string(dtype_name(got.dtype)));
  if (got.shape != want.shape)
    return invalid_argument(v + "tensor '" + got.name + "': shape expected " + want.shape_string() + ", got " +
                            got.shape_string());
  return Status();
}
}  // namespace

Status PublisherImpl::stream_send(StreamState& st, const TensorView& t, void* after_stream) {
  if (st.ended) return invalid_argument("update v" + std::to_string(st.plan.version) + " has ended");
  if (!st.status.ok()) return st.status;
  const std::string v = "update v" + std::to_string(st.plan.version) + ": ";
  auto tr = st.transforms.find(t.spec.name);
  if (tr == st.transforms.end()) {
    if (auto scale = st.scales.find(t.spec.name); scale != st.scales.end()) {
      const Status bad = invalid_argument(v + "tensor '" + t.spec.name + "' is the scales of '" + scale->second +
                                          "', which its transform sends: send '" + scale->second + "' only");
      stream_abort(st, bad.message());
      st.status = st.r.status = bad;
      return bad;
    }
    return stream_send_wire(st, t, after_stream);
  }
  // A tensor a rule transforms: checked against what the caller said it
  // would send, transformed here (host memory held until its sends return).
  const Status bad = spec_mismatch(v, t.spec, tr->second.first);
  auto wire = bad.ok() ? transform::apply_all({t}, st.rules) : StatusOr<transform::Transformed>(bad);
  if (!wire.ok()) {
    stream_abort(st, wire.status().message());
    st.status = st.r.status = wire.status();
    return wire.status();
  }
  for (const auto& piece : wire->views) PC_RETURN_IF_ERROR(stream_send_wire(st, piece, nullptr));
  return Status();
}

Status PublisherImpl::stream_send_wire(StreamState& st, const TensorView& t, void* after_stream) {
  if (!st.status.ok()) return st.status;
  const std::string v = "update v" + std::to_string(st.plan.version) + ": ";
  Status bad;
  auto it = st.index.find(t.spec.name);
  if (it == st.index.end()) {
    bad = invalid_argument(v + "tensor '" + t.spec.name + "' is not in the update's manifest");
  } else if (st.sent[it->second]) {
    bad = invalid_argument(v + "tensor '" + t.spec.name + "' was sent already");
  } else if (bad = spec_mismatch(v, t.spec, st.plan.tensors[it->second]); bad.ok()) {
    if (t.device != cfg_.publisher.device)
      bad = invalid_argument(v + "tensor '" + t.spec.name + "' is on " + t.device.to_string() +
                             " but publisher.device is " + cfg_.publisher.device.to_string());
    else if (st.plan.nbytes[it->second] > 0 && !t.data)
      bad = invalid_argument(v + "tensor '" + t.spec.name + "' has no data pointer");
  }
  if (!bad.ok()) {
    // A wrong tensor ends the update: the engines must not take a version
    // the trainer did not mean.
    stream_abort(st, bad.message());
    st.status = st.r.status = bad;
    return bad;
  }
  Status s = st.sender->send(it->second, t.data, after_stream);
  if (!s.ok()) {
    st.status = end_move(st.plan, st.move, s);
    return st.status;
  }
  st.sent[it->second] = true;
  ++st.sent_count;
  return Status();
}

UpdateResult PublisherImpl::stream_finish(StreamState& st) {
  if (st.ended) return st.r;
  if (st.moving && st.status.ok() && st.sent_count < st.plan.tensors.size()) {
    std::string missing;
    size_t listed = 0;
    for (size_t i = 0; i < st.sent.size(); ++i)
      if (!st.sent[i] && listed++ < 4) missing += (missing.empty() ? "'" : ", '") + st.plan.tensors[i].name + "'";
    if (listed > 4) missing += ", +" + std::to_string(listed - 4) + " more";
    const Status bad = invalid_argument("update v" + std::to_string(st.plan.version) + " finished with " +
                                        std::to_string(st.sent_count) + " of its " +
                                        std::to_string(st.plan.tensors.size()) + " tensors sent; not sent: " + missing);
    stream_abort(st, bad.message());
    st.status = st.r.status = bad;
  }
  if (st.moving && !st.ended) {
    Status data = st.status.ok() ? end_move(st.plan, st.move, st.sender->finish()) : st.status;
    st.r.buckets = st.plan.buckets.size();
    st.r.wire_bytes = st.sender->wire_bytes();
    st.r.delta = st.sender->delta_buckets() > 0;
    collect_applied(st.plan, data, st.r);  // 5. applied
  }
  st.ended = true;
  st.r.seconds = std::chrono::duration<double>(Clock::now() - st.t0).count();
  log_result(st.r);
  release(st);
  return st.r;
}

// Ends an update that will not finish: the communicator is aborted (the
// collective is half-done, the next update re-forms the group) and every
// member told to give the update up; each is left dirty at its version.
void PublisherImpl::stream_abort(StreamState& st, const std::string& why) {
  if (st.ended) return;
  st.ended = true;
  if (st.moving) {
    PC_WARN("publisher: update v" << st.plan.version << " aborted: " << why);
    st.sender->abort(why);
    {
      std::lock_guard<std::mutex> lock(mu_);
      active_comm_.reset();
      needs_reform_ = true;
      abandon_locked(st.plan.version, "the trainer aborted the update: " + why);
      round_.end();
    }
    comm_.reset();
  }
  if (st.status.ok()) st.status = st.r.status = aborted(why);
  st.r.seconds = std::chrono::duration<double>(Clock::now() - st.t0).count();
  counters_.record(st.r.status, st.r.seconds, 0, 0, st.r.data_seconds, st.r.apply_seconds);
  release(st);
}

void PublisherImpl::release(StreamState& st) {
  if (!st.lock.owns_lock()) return;
  streaming_ = false;
  st.lock.unlock();
}

// ------------------------------------------------------------ public handle
Update::Update(PublisherImpl* impl, std::unique_ptr<StreamState> state) : impl_(impl), state_(std::move(state)) {}
Update::~Update() { abort("the Update was destroyed before finish()"); }
Status Update::status() const { return state_->status; }
uint64_t Update::version() const { return state_->r.version; }
Status Update::send(const TensorView& tensor, void* after_stream) { return impl_->stream_send(*state_, tensor, after_stream); }
UpdateResult Update::finish() { return impl_->stream_finish(*state_); }
void Update::abort(const std::string& why) {
  if (state_->ended) return;
  if (!state_->moving) {  // nothing went out: the result of begin stands
    impl_->stream_finish(*state_);
    return;
  }
  impl_->stream_abort(*state_, why);
}

std::unique_ptr<Update> Publisher::begin_update(const std::vector<TensorSpec>& manifest, const UpdateOptions& options) {
  return std::unique_ptr<Update>(new Update(impl_.get(), impl_->begin_stream(manifest, options)));
}

}  // namespace paramcast
