// paramcast.Config from a YAML file, YAML text, or a dict with the YAML's keys.
//
// A dict is written out as YAML and read by the same loader as a file, so
// every check and every error message (naming the key, the bad value and what
// was expected) is the file's.
#include <yaml-cpp/yaml.h>

#include "common/config.h"
#include "python/bindings.h"
#include "python/errors.h"

namespace paramcast::python {
namespace {

YAML::Node to_yaml(py::handle v, const std::string& path) {
  if (v.is_none()) return YAML::Node(YAML::NodeType::Null);
  if (py::isinstance<py::bool_>(v)) return YAML::Node(v.cast<bool>());
  if (py::isinstance<py::int_>(v)) return YAML::Node(v.cast<long long>());
  if (py::isinstance<py::float_>(v)) return YAML::Node(v.cast<double>());
  if (py::isinstance<py::str>(v)) return YAML::Node(v.cast<std::string>());
  if (py::isinstance<py::dict>(v)) {
    YAML::Node n(YAML::NodeType::Map);
    for (auto [k, item] : v.cast<py::dict>()) {
      if (!py::isinstance<py::str>(k))
        throw py::type_error("config key '" + path + "': keys must be strings, got " +
                             std::string(py::str(py::repr(k))));
      std::string key = k.cast<std::string>();
      n[key] = to_yaml(item, path.empty() ? key : path + "." + key);
    }
    return n;
  }
  if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
    YAML::Node n(YAML::NodeType::Sequence);
    size_t i = 0;
    for (auto item : v) n.push_back(to_yaml(item, path + "[" + std::to_string(i++) + "]"));
    return n;
  }
  throw py::type_error("config key '" + path + "': a value of type " +
                       std::string(py::str(py::type::of(v).attr("__name__"))) +
                       " cannot be written as YAML (expected str, int, float, bool, list or dict)");
}

Config checked(StatusOr<Config> c) {
  if (!c.ok()) throw_status(c.status(), "ConfigError");
  return std::move(c.value());
}

}  // namespace

Config config_from_dict(const py::dict& d) {
  YAML::Emitter out;
  out << to_yaml(d, "");
  return checked(load_config_string(out.c_str(), "<dict>"));
}

void bind_config(py::module_& m) {
  py::class_<Config>(m, "Config", "A checked ParamCast configuration (see deploy/*.yaml for the keys).")
      .def_property_readonly("source", [](const Config& c) { return c.source; })
      .def_property_readonly("endpoint", [](const Config& c) { return c.control.endpoint; })
      .def_property_readonly("worker_ids", &Config::worker_ids)
      .def_property_readonly(
          "transforms",
          [](const Config& c) {
            // publisher.transforms as the YAML states them: what a trainer
            // tells its engines (the wire names of the scales).
            py::list rules;
            for (const auto& r : c.publisher.transforms) {
              py::dict rule;
              rule["match"] = r.match;
              if (r.cast)
                rule["cast"] = *r.cast == DType::kBF16 ? "bf16" : *r.cast == DType::kF16 ? "fp16" : "fp32";
              if (r.fp8)
                rule["fp8"] = *r.fp8 == transform::Fp8Scaling::kBlock     ? "block"
                              : *r.fp8 == transform::Fp8Scaling::kChannel ? "channel"
                                                                          : "tensor";
              if (r.keep) rule["keep"] = true;
              rules.append(rule);
            }
            return rules;
          },
          "publisher.transforms as rules in the YAML's keys ({'match': ..., 'fp8': 'block'}); [] if none.")
      .def_property_readonly("heartbeat_timeout",
                             [](const Config& c) { return c.control.heartbeat_timeout.count() / 1000.0; })
      .def("with_endpoint",
           [](const Config& c, const std::string& endpoint) {
             Config copy = c;
             copy.control.endpoint = endpoint;
             return copy;
           },
           py::arg("endpoint"), "A copy connecting to (or binding) `endpoint` instead.");
  m.def("load_config_file", [](const std::string& path) { return checked(load_config_file(path)); }, py::arg("path"));
  m.def("load_config_string",
        [](const std::string& yaml, const std::string& name) { return checked(load_config_string(yaml, name)); },
        py::arg("yaml"), py::arg("name") = "<string>");
  m.def("config_from_dict", &config_from_dict, py::arg("config"));
}

}  // namespace paramcast::python
