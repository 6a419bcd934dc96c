// paramcast._core.Subscriber: the C++ Subscriber with Python callbacks.
//
// Callbacks run on the subscriber's data thread and take the GIL for the
// call. A Python exception in any of them fails that update with
// "callback: TypeName: message" (REJECTED), which the publisher's result
// carries for this worker; the weight state becomes dirty. on_update_begin
// cannot fail in C++, so its exception is kept and returned by the
// on_update_end hook, which always runs when an update was taken.
#include <cstdio>
#include <map>
#include <mutex>

#include "inference_side/subscriber.h"
#include "python/bindings.h"
#include "python/errors.h"
#include "python/tensors.h"

namespace paramcast::python {
namespace {

// The Python side of the hooks; the C++ hooks hold it by shared_ptr, and it
// is released with the GIL held after the subscriber's threads have stopped.
struct Callbacks {
  py::object on_tensor, on_begin, on_end;  // None when unset
  std::string begin_error;                 // guarded by the GIL
  // Each registered tensor and where its bytes were then (its data_ptr()),
  // by name (the last registration wins); guarded by the GIL.
  std::map<std::string, std::pair<py::object, uintptr_t>> registered;
};

// Where a registered object's bytes are now: torch's data_ptr(), or 0 (an
// object that cannot say; never counted as moved).
uintptr_t bytes_at(const py::object& tensor) {
  if (!py::hasattr(tensor, "data_ptr")) return 0;
  try {
    return tensor.attr("data_ptr")().cast<uintptr_t>();
  } catch (const py::error_already_set&) {
    return 0;
  }
}

Status failed_callback(const char* which, const py::error_already_set& e) {
  return rejected(std::string(which) + " callback raised " + describe(e));
}

class PySubscriber {
 public:
  PySubscriber(const Config& config, const std::string& worker_id)
      : device_(config.device_for_worker(worker_id)), cb_(std::make_shared<Callbacks>()) {
    set_log_level(config.log_level);
    set_log_format(config.log_format);  // logging.level: the process's, as in the tools
    auto s = Subscriber::create(config, worker_id);
    if (!s.ok()) throw_status(s.status());
    sub_ = std::move(s.value());
    install_hooks();
  }
  ~PySubscriber() { stop(); }

  // `owner`: the caller's own tensor when `tensor` is an alias of it (a
  // detached view): where the owner's bytes are is what is checked.
  void register_tensor(const std::string& name, py::handle tensor, std::optional<std::string> dtype,
                       py::object owner) {
    BorrowedTensor b = import_tensor(name, tensor, dtype, device_, std::nullopt);
    Status s = live().register_tensor(b.view);
    if (!s.ok()) throw_status(s);
    remember(name, owner.is_none() ? tensor : owner);
    keep_.push_back(std::move(b.keepalive));
    keep_.push_back(py::reinterpret_borrow<py::object>(tensor));
  }

  // A slice this engine serves (tensor parallelism): `tensor` holds the box
  // at `offsets` of the full tensor of `full_shape`.
  void register_slice(const std::string& name, py::handle tensor, std::optional<std::string> dtype,
                      const std::vector<int64_t>& full_shape, const std::vector<int64_t>& offsets, py::object owner) {
    BorrowedTensor b = import_tensor(name, tensor, dtype, device_, std::nullopt);
    ShardView v;
    v.local = b.view;
    v.full_shape = full_shape;
    v.offsets = offsets;
    Status s = live().register_slice(v);
    if (!s.ok()) throw_status(s);
    remember(name, owner.is_none() ? tensor : owner);
    keep_.push_back(std::move(b.keepalive));
    keep_.push_back(py::reinterpret_borrow<py::object>(tensor));
  }

  // A registration, and where its bytes are (GIL held).
  void remember(const std::string& name, py::handle tensor) {
    auto obj = py::reinterpret_borrow<py::object>(tensor);
    const uintptr_t at = bytes_at(obj);
    cb_->registered[name] = {std::move(obj), at};
  }

  // fn(TensorRef) for every tensor not registered in place.
  void on_tensor(py::object fn) {
    cb_->on_tensor = std::move(fn);
    live().on_tensor([cb = cb_](const TensorView& view) -> Status {
      py::gil_scoped_acquire gil;
      try {
        cb->on_tensor(export_view(view));
      } catch (py::error_already_set& e) {
        return failed_callback("on_weights", e);
      }
      return Status();
    });
  }
  void on_update_begin(py::object fn) { cb_->on_begin = std::move(fn); }
  void on_update_end(py::object fn) { cb_->on_end = std::move(fn); }

  void start() {
    Status s;
    {
      py::gil_scoped_release release;
      s = live().start();
    }
    if (!s.ok()) throw_status(s);
  }

  void stop() {
    if (!sub_) return;
    {
      py::gil_scoped_release release;  // the data thread may be waiting for the GIL
      sub_->stop();
      sub_.reset();
    }
    keep_.clear();
  }

  py::tuple state() const {
    WeightState s = live().state();
    return py::make_tuple(std::string(weight_state_name(s.kind)), s.version, s.dirty_version, s.to_string());
  }

  bool joined() const { return live().joined(); }
  std::string metrics_endpoint() const { return sub_ ? sub_->metrics_endpoint() : ""; }

  // The next finished update as (version, error or ""), waiting up to `seconds` without the GIL.
  py::object next_report(double seconds) {
    std::optional<UpdateReport> r;
    Subscriber& s = live();
    {
      py::gil_scoped_release release;
      r = s.next_report(std::chrono::milliseconds(static_cast<int64_t>(std::max(0.0, seconds) * 1000)));
    }
    if (!r) return py::none();
    return py::make_tuple(r->version, r->status.ok() ? "" : r->status.to_string(), r->bytes, r->seconds);
  }

 private:
  Subscriber& live() const {
    if (!sub_) throw_status(unavailable("the subscriber is stopped"));
    return *sub_;
  }

  void install_hooks() {
    // A registered tensor whose storage moved (share_memory_(), resize_(),
    // a new .data) would have the update write where its bytes no longer
    // are: this engine fails the update, naming it, before any byte moves
    // (checked on the data thread, which takes the GIL for the hooks too).
    sub_->check_registrations([cb = cb_]() {
      std::vector<Mismatch> moved;
      py::gil_scoped_acquire gil;
      for (const auto& [name, held] : cb->registered) {
        const uintptr_t now = bytes_at(held.first);
        if (!held.second || !now || now == held.second) continue;
        char where[64];
        std::snprintf(where, sizeof where, "0x%llx", static_cast<unsigned long long>(held.second));
        std::string expected = std::string("its bytes where they were registered (") + where + ")";
        std::snprintf(where, sizeof where, "0x%llx", static_cast<unsigned long long>(now));
        moved.push_back({Mismatch::Kind::kOther, name, expected,
                         std::string("its storage moved to ") + where +
                             " (share_memory_(), resize_() or a replaced .data): register it again"});
      }
      return moved;
    });
    sub_->on_update_begin([cb = cb_](uint64_t version) {
      py::gil_scoped_acquire gil;
      cb->begin_error.clear();
      if (!cb->on_begin || cb->on_begin.is_none()) return;
      try {
        cb->on_begin(version);
      } catch (py::error_already_set& e) {
        cb->begin_error = failed_callback("on_update_begin", e).message();
      }
    });
    sub_->on_update_end([cb = cb_](uint64_t version, const Status& s) -> Status {
      py::gil_scoped_acquire gil;
      Status out = cb->begin_error.empty() ? Status() : rejected(cb->begin_error);
      cb->begin_error.clear();
      if (!cb->on_end || cb->on_end.is_none()) return out;
      try {
        cb->on_end(version, s.ok() ? py::object(py::none()) : py::object(py::str(s.to_string())));
      } catch (py::error_already_set& e) {
        if (out.ok()) out = failed_callback("on_update_end", e);
      }
      return out;
    });
  }

  Device device_;
  std::shared_ptr<Callbacks> cb_;
  std::unique_ptr<Subscriber> sub_;
  std::vector<py::object> keep_;  // registered tensors and their capsules
};

}  // namespace

void bind_subscriber(py::module_& m) {
  py::class_<PySubscriber>(m, "Subscriber")
      .def(py::init<const Config&, const std::string&>(), py::arg("config"), py::arg("worker_id"))
      .def("register_tensor", &PySubscriber::register_tensor, py::arg("name"), py::arg("tensor"),
           py::arg("dtype") = py::none(), py::arg("owner") = py::none())
      .def("register_slice", &PySubscriber::register_slice, py::arg("name"), py::arg("tensor"), py::arg("dtype"),
           py::arg("full_shape"), py::arg("offsets"), py::arg("owner") = py::none())
      .def("on_tensor", &PySubscriber::on_tensor)
      .def("on_update_begin", &PySubscriber::on_update_begin)
      .def("on_update_end", &PySubscriber::on_update_end)
      .def("start", &PySubscriber::start)
      .def("stop", &PySubscriber::stop)
      .def("state", &PySubscriber::state)
      .def("joined", &PySubscriber::joined)
      .def_property_readonly("metrics_endpoint", &PySubscriber::metrics_endpoint)
      .def("next_report", &PySubscriber::next_report, py::arg("seconds"));
}

}  // namespace paramcast::python
