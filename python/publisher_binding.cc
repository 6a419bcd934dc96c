// paramcast._core.Publisher: the C++ Publisher with the GIL released while it
// works. weight_update is split in submit() and UpdateHandle.wait(seconds) so
// that Python waits in slices and stays interruptible (Ctrl-C): an
// interrupted update goes on in the background, and the handle keeps the
// caller's tensors alive until it has finished.
#include <chrono>
#include <future>

#include "python/bindings.h"
#include "python/errors.h"
#include "python/tensors.h"
#include "trainer_side/publisher.h"

namespace paramcast::python {
namespace {

// An update's transforms (a list of rule dicts, as publisher.transforms
// takes them in YAML), read by the same loader; None: the config's.
std::optional<std::vector<transform::Rule>> rules_from(const py::object& rules) {
  if (rules.is_none()) return std::nullopt;
  py::dict publisher, config;
  publisher["transforms"] = rules;
  config["publisher"] = publisher;
  return config_from_dict(config).publisher.transforms;
}

class UpdateHandle {
 public:
  UpdateHandle(std::shared_future<UpdateResult> f, std::vector<py::object> keep)
      : future_(std::move(f)), keep_(std::move(keep)) {}
  ~UpdateHandle() {
    py::gil_scoped_release release;
    if (future_.valid()) future_.wait();  // the tensors in keep_ are read until then
  }

  // True when the update has finished; waits at most `seconds` without the GIL.
  bool wait(double seconds) {
    if (result_) return true;
    py::gil_scoped_release release;
    auto slice = std::chrono::duration<double>(seconds < 0 ? 0 : seconds);
    return future_.wait_for(slice) == std::future_status::ready;
  }

  const UpdateResult& result() {
    if (!result_) {
      py::gil_scoped_release release;
      result_ = future_.get();  // a copy: shared_future
    }
    return *result_;
  }

 private:
  std::shared_future<UpdateResult> future_;
  std::optional<UpdateResult> result_;
  std::vector<py::object> keep_;
};

// paramcast._core.Update: one streamed update. Each send() borrows the
// tensor only for the call (its bytes are staged or on the wire when it
// returns); every call that waits does so without the GIL.
class PyUpdate {
 public:
  // Holds the publisher: an open update keeps it alive after close().
  PyUpdate(std::shared_ptr<Publisher> pub, std::unique_ptr<Update> u, Device device)
      : pub_(std::move(pub)), u_(std::move(u)), device_(device) {}
  ~PyUpdate() {
    py::gil_scoped_release release;
    u_.reset();  // an unfinished update is aborted
  }

  bool ok() const { return u_->ok(); }
  std::string error() const { return u_->ok() ? "" : u_->status().to_string(); }
  uint64_t version() const { return u_->version(); }

  void send(const std::string& name, py::handle tensor, std::optional<std::string> dtype,
            std::optional<intptr_t> stream) {
    BorrowedTensor b = import_tensor(name, tensor, dtype, device_, stream);
    Status s;
    {
      py::gil_scoped_release release;
      s = u_->send(b.view, stream ? reinterpret_cast<void*>(*stream) : nullptr);
    }
    if (!s.ok()) throw_status(s);
  }

  UpdateResult finish() {
    py::gil_scoped_release release;
    return u_->finish();
  }

  void abort(const std::string& why) {
    py::gil_scoped_release release;
    u_->abort(why);
  }

 private:
  std::shared_ptr<Publisher> pub_;
  std::unique_ptr<Update> u_;
  Device device_;
};

// (name, local tensor, dtype override or None, full shape, offsets) -> ShardView; CUDA
// tensors are read after `stream` (the caller's current stream).
void import_shards(const py::list& items, Device device, uintptr_t stream, std::vector<ShardView>& shards,
                   std::vector<py::object>& keep) {
  shards.reserve(items.size());
  for (auto item : items) {
    auto t = item.cast<py::tuple>();
    auto name = t[0].cast<std::string>();
    auto dtype = t[2].cast<std::optional<std::string>>();
    BorrowedTensor b = import_tensor(name, t[1], dtype, device,
                                     device.is_cuda() && stream ? std::optional<intptr_t>(static_cast<intptr_t>(stream))
                                                                : std::nullopt);
    ShardView v;
    v.local = b.view;
    v.full_shape = t[3].cast<std::vector<int64_t>>();
    v.offsets = t[4].cast<std::vector<int64_t>>();
    shards.push_back(std::move(v));
    keep.push_back(std::move(b.keepalive));
    keep.push_back(py::reinterpret_borrow<py::object>(t[1]));
  }
}

// paramcast._core.PublisherRank: trainer rank r > 0 of a many-sender job.
class PyPublisherRank {
 public:
  PyPublisherRank(const Config& config, int rank) : device_(config.publisher.device) {
    set_log_level(config.log_level);
    set_log_format(config.log_format);
    auto r = PublisherRank::create(config, rank);
    if (!r.ok()) throw_status(r.status());
    rank_ = std::move(r.value());
  }
  ~PyPublisherRank() { close(); }

  std::string id() const { return rank_ ? rank_->id() : ""; }

  void start() {
    Status s;
    {
      py::gil_scoped_release release;
      s = live().start();
    }
    if (!s.ok()) throw_status(s);
  }

  std::shared_ptr<UpdateHandle> submit(const py::list& items, std::optional<uint64_t> step, uintptr_t after_stream) {
    std::vector<ShardView> shards;
    std::vector<py::object> keep;
    import_shards(items, device_, after_stream, shards, keep);
    PublisherRank& r = live();
    std::shared_future<UpdateResult> f;
    {
      py::gil_scoped_release release;
      void* stream = reinterpret_cast<void*>(after_stream);
      f = std::async(std::launch::async, [&r, shards = std::move(shards), step, stream] {
            return r.weight_update(shards, step, stream);
          }).share();
    }
    std::erase_if(running_, [](const auto& x) { return x.wait_for(std::chrono::seconds(0)) == std::future_status::ready; });
    running_.push_back(f);
    return std::make_shared<UpdateHandle>(std::move(f), std::move(keep));
  }

  void close() {
    if (!rank_) return;
    py::gil_scoped_release release;
    rank_->stop();  // a call in flight ends now
    for (auto& r : running_) r.wait();
    running_.clear();
    rank_.reset();
  }

 private:
  PublisherRank& live() const {
    if (!rank_) throw_status(unavailable("the trainer rank is closed"));
    return *rank_;
  }
  const Device device_;  // publisher.device: where this rank's shards are
  std::unique_ptr<PublisherRank> rank_;
  std::vector<std::shared_future<UpdateResult>> running_;
};

class PyPublisher {
 public:
  explicit PyPublisher(const Config& config) : device_(config.publisher.device) {
    set_log_level(config.log_level);
    set_log_format(config.log_format);  // logging.level: the process's, as in the tools
    auto p = Publisher::create(config);
    if (!p.ok()) throw_status(p.status());
    pub_ = std::move(p.value());
  }
  ~PyPublisher() { close(); }

  std::string endpoint() const { return pub_ ? pub_->endpoint() : ""; }
  std::string metrics_endpoint() const { return pub_ ? pub_->metrics_endpoint() : ""; }

  void start() {
    Status s;
    {
      py::gil_scoped_release release;
      s = live().start();
    }
    if (!s.ok()) throw_status(s);
  }

  // items: (name, tensor, dtype override or None, CUDA stream or None).
  std::shared_ptr<UpdateHandle> submit(const py::list& items, std::optional<uint64_t> version, uintptr_t after_stream,
                                       bool partial, const py::object& transforms) {
    std::vector<TensorView> views;
    std::vector<py::object> keep;
    views.reserve(items.size());
    for (auto item : items) {
      auto t = item.cast<py::tuple>();
      auto name = t[0].cast<std::string>();
      auto dtype = t[2].cast<std::optional<std::string>>();
      auto stream = t[3].cast<std::optional<intptr_t>>();
      BorrowedTensor b = import_tensor(name, t[1], dtype, device_, stream);
      views.push_back(b.view);
      keep.push_back(std::move(b.keepalive));
      keep.push_back(py::reinterpret_borrow<py::object>(t[1]));
    }
    UpdateOptions options;
    options.version = version;
    options.after_stream = reinterpret_cast<void*>(after_stream);
    options.partial = partial;
    options.transforms = rules_from(transforms);
    Publisher& p = live();
    std::shared_future<UpdateResult> f;
    {
      py::gil_scoped_release release;
      f = p.weight_update_async(std::move(views), options).share();
    }
    std::erase_if(running_, [](const auto& r) { return r.wait_for(std::chrono::seconds(0)) == std::future_status::ready; });
    running_.push_back(f);
    return std::make_shared<UpdateHandle>(std::move(f), std::move(keep));
  }

  // A many-sender update (publisher.ranks > 1): items are (name, local
  // tensor, dtype override or None, full shape, offsets): this rank's shards.
  std::shared_ptr<UpdateHandle> submit_sharded(const py::list& items, std::optional<uint64_t> version,
                                               uintptr_t after_stream) {
    std::vector<ShardView> shards;
    std::vector<py::object> keep;
    import_shards(items, device_, after_stream, shards, keep);
    UpdateOptions options;
    options.version = version;
    options.after_stream = reinterpret_cast<void*>(after_stream);
    Publisher& p = live();
    std::shared_future<UpdateResult> f;
    {
      py::gil_scoped_release release;
      f = std::async(std::launch::async, [&p, shards = std::move(shards), options] {
            return p.weight_update_sharded(shards, options);
          }).share();
    }
    std::erase_if(running_, [](const auto& r) { return r.wait_for(std::chrono::seconds(0)) == std::future_status::ready; });
    running_.push_back(f);
    return std::make_shared<UpdateHandle>(std::move(f), std::move(keep));
  }

  // manifest: (name, ParamCast dtype name, shape) triples.
  std::unique_ptr<PyUpdate> begin_update(const py::list& manifest, std::optional<uint64_t> version, bool partial,
                                         const py::object& transforms) {
    std::vector<TensorSpec> specs;
    specs.reserve(manifest.size());
    for (auto item : manifest) {
      auto t = item.cast<py::tuple>();
      TensorSpec spec;
      spec.name = t[0].cast<std::string>();
      const auto dtype_text = t[1].cast<std::string>();
      auto dtype = parse_dtype(dtype_text);
      if (!dtype)
        throw_status(invalid_argument("manifest: tensor '" + spec.name + "' has unknown dtype '" + dtype_text + "'"));
      spec.dtype = *dtype;
      spec.shape = t[2].cast<std::vector<int64_t>>();
      specs.push_back(std::move(spec));
    }
    UpdateOptions options;
    options.version = version;
    options.partial = partial;
    options.transforms = rules_from(transforms);
    Publisher& p = live();
    std::unique_ptr<Update> u;
    {
      py::gil_scoped_release release;
      u = p.begin_update(specs, options);
    }
    return std::make_unique<PyUpdate>(pub_, std::move(u), device_);
  }

  py::dict stats() const {
    PublisherStats s = live().stats();
    py::dict d;
    d["epoch"] = s.epoch;
    d["version"] = s.published_version;
    d["live_members"] = s.live_members;
    d["dropped_frames"] = s.dropped_frames;
    d["staging_peak_bytes"] = s.staging_peak_bytes;
    d["baseline_bytes"] = s.baseline_bytes;
    d["baseline_version"] = s.baseline_version;
    return d;
  }

  // The version an update submitted now would get (above every version
  // issued or held: a failed update's version is never reused). Waits for
  // an update in progress.
  uint64_t next_version() const {
    Publisher& p = live();
    py::gil_scoped_release nogil;
    return p.next_version();
  }

  py::object poll_event() {
    auto e = live().poll_event();
    if (!e) return py::none();
    return py::make_tuple(std::string(member_event_name(e->kind)), e->worker_id, e->detail);
  }

  void close() {
    if (!pub_) return;
    py::gil_scoped_release release;
    pub_->shutdown();                    // an update in flight fails now
    for (auto& r : running_) r.wait();  // and still uses the publisher until it returns
    running_.clear();
    pub_.reset();
  }

 private:
  Publisher& live() const {
    if (!pub_) throw_status(unavailable("the publisher is closed"));
    return *pub_;
  }

  Device device_;
  std::shared_ptr<Publisher> pub_;
  std::vector<std::shared_future<UpdateResult>> running_;
};

void bind_results(py::module_& m) {
  py::class_<PyUpdate>(m, "Update")
      .def_property_readonly("ok", &PyUpdate::ok)
      .def_property_readonly("error", &PyUpdate::error)
      .def_property_readonly("version", &PyUpdate::version)
      .def("send", &PyUpdate::send, py::arg("name"), py::arg("tensor"), py::arg("dtype"), py::arg("stream"))
      .def("finish", &PyUpdate::finish)
      .def("abort", &PyUpdate::abort, py::arg("why"));
  py::class_<Mismatch>(m, "Mismatch")
      .def_readonly("name", &Mismatch::name)
      .def_readonly("expected", &Mismatch::expected)
      .def_readonly("got", &Mismatch::got)
      .def("__str__", &Mismatch::to_string)
      .def("__repr__", [](const Mismatch& x) { return "<Mismatch " + x.to_string() + ">"; });
  py::class_<SubscriberOutcome>(m, "SubscriberOutcome")
      .def_readonly("worker_id", &SubscriberOutcome::worker_id)
      .def_property_readonly("ok", [](const SubscriberOutcome& o) { return o.status.ok(); })
      .def_property_readonly("error", [](const SubscriberOutcome& o) { return o.status.ok() ? "" : o.status.to_string(); })
      .def_readonly("mismatches", &SubscriberOutcome::mismatches)
      .def_readonly("bytes", &SubscriberOutcome::bytes)
      .def_readonly("seconds", &SubscriberOutcome::seconds)
      .def_property_readonly("rate", &SubscriberOutcome::rate)
      .def_readonly("link_rate", &SubscriberOutcome::link_rate)
      .def_readonly("shed", &SubscriberOutcome::shed)
      .def_readonly("refused_delta", &SubscriberOutcome::refused_delta)
      .def_readonly("unconfirmed", &SubscriberOutcome::unconfirmed)
      .def("__repr__", [](const SubscriberOutcome& o) {
        return "<SubscriberOutcome " + o.worker_id + " " + (o.status.ok() ? "applied" : o.status.to_string()) + ">";
      });
  py::class_<UpdateResult>(m, "UpdateResult")
      .def_property_readonly("ok", &UpdateResult::ok)
      .def_property_readonly("error", [](const UpdateResult& r) { return r.ok() ? "" : r.status.to_string(); })
      .def_property_readonly("code", [](const UpdateResult& r) { return std::string(code_name(r.status.code())); })
      .def_readonly("version", &UpdateResult::version)
      .def_readonly("epoch", &UpdateResult::epoch)
      .def_readonly("bytes", &UpdateResult::bytes)
      .def_readonly("wire_bytes", &UpdateResult::wire_bytes)
      .def_readonly("plan_whole_bytes", &UpdateResult::plan_whole_bytes)
      .def_readonly("plan_referred_bytes", &UpdateResult::plan_referred_bytes)
      .def_readonly("plan_referred", &UpdateResult::plan_referred)
      .def_readonly("plan_kept", &UpdateResult::plan_kept)
      .def_readonly("parts_referred", &UpdateResult::parts_referred)
      .def_readonly("holdings_bytes", &UpdateResult::holdings_bytes)
      .def_readonly("delta", &UpdateResult::delta)
      .def_readonly("dense_because", &UpdateResult::dense_because)
      .def_readonly("tensors", &UpdateResult::tensors)
      .def_readonly("transformed", &UpdateResult::transformed)
      .def_readonly("buckets", &UpdateResult::buckets)
      .def_readonly("seconds", &UpdateResult::seconds)
      .def_property_readonly("gbps", &UpdateResult::gbps)
      .def_readonly("data_seconds", &UpdateResult::data_seconds)
      .def_readonly("apply_seconds", &UpdateResult::apply_seconds)
      .def_readonly("last_to_apply", &UpdateResult::last_to_apply)
      .def_property_readonly("data_gbps", &UpdateResult::data_gbps)
      .def_readonly("subscribers", &UpdateResult::subscribers)
      .def_readonly("missing", &UpdateResult::missing)
      .def_readonly("shed", &UpdateResult::shed)
      .def_readonly("refused_delta", &UpdateResult::refused_delta)
      .def_readonly("unconfirmed", &UpdateResult::unconfirmed)
      .def_readonly("precommitted", &UpdateResult::precommitted)
      .def_readonly("slowest", &UpdateResult::slowest)
      .def_property_readonly("mismatches", [](const UpdateResult& r) {
        py::list out;  // (worker, Mismatch) over every subscriber
        for (const auto& o : r.subscribers)
          for (const auto& x : o.mismatches) out.append(py::make_tuple(o.worker_id, x));
        return out;
      })
      .def("__repr__", [](const UpdateResult& r) {
        return "<UpdateResult v" + std::to_string(r.version) + " " + (r.ok() ? "ok" : r.status.to_string()) + ">";
      });
}

}  // namespace

void bind_publisher(py::module_& m) {
  bind_results(m);
  // Which rule of `rules` (as publisher.transforms takes them) decides
  // tensor `name`: its index, or None (it travels as it is). The core's own
  // matching (common/transform), so that Python never matches otherwise.
  m.def(
      "transform_rule_index",
      [](const py::object& rules, const std::string& name) -> py::object {
        const auto parsed = rules_from(rules);
        if (!parsed) return py::none();
        for (size_t i = 0; i < parsed->size(); ++i)
          if (transform::glob_match((*parsed)[i].match, name)) return py::int_(i);
        return py::none();
      },
      py::arg("rules"), py::arg("name"));
  py::class_<UpdateHandle, std::shared_ptr<UpdateHandle>>(m, "UpdateHandle")
      .def("wait", &UpdateHandle::wait, py::arg("seconds"))
      .def("result", &UpdateHandle::result, py::return_value_policy::copy);
  py::class_<PyPublisher>(m, "Publisher")
      .def(py::init<const Config&>(), py::arg("config"))
      .def_property_readonly("endpoint", &PyPublisher::endpoint)
      .def_property_readonly("metrics_endpoint", &PyPublisher::metrics_endpoint)
      .def("start", &PyPublisher::start)
      .def("submit", &PyPublisher::submit, py::arg("items"), py::arg("version"), py::arg("after_stream"),
           py::arg("partial") = false, py::arg("transforms") = py::none())
      .def("submit_sharded", &PyPublisher::submit_sharded, py::arg("items"), py::arg("version"),
           py::arg("after_stream") = 0)
      .def("begin_update", &PyPublisher::begin_update, py::arg("manifest"), py::arg("version"), py::arg("partial"),
           py::arg("transforms") = py::none())
      .def("stats", &PyPublisher::stats)
      .def("next_version", &PyPublisher::next_version)
      .def("poll_event", &PyPublisher::poll_event)
      .def("close", &PyPublisher::close);
  py::class_<PyPublisherRank>(m, "PublisherRank")
      .def(py::init<const Config&, int>(), py::arg("config"), py::arg("rank"))
      .def_property_readonly("id", &PyPublisherRank::id)
      .def("start", &PyPublisherRank::start)
      .def("submit", &PyPublisherRank::submit, py::arg("items"), py::arg("step") = py::none(),
           py::arg("after_stream") = 0)
      .def("close", &PyPublisherRank::close);
}

}  // namespace paramcast::python
