// Tiny flag parsing shared by the command-line tools: --name value / --flag.
#pragma once

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/units.h"

namespace paramcast {

struct Flags {
  std::map<std::string, std::string> values;
  std::vector<std::string> positional;
  std::string error;  // set when parsing failed

  bool has(const std::string& k) const { return values.count(k) > 0; }
  std::string get(const std::string& k, const std::string& def = "") const {
    auto it = values.find(k);
    return it == values.end() ? def : it->second;
  }
};

// `boolean` names flags that take no value.
inline Flags parse_flags(int argc, char** argv, int first, const std::vector<std::string>& boolean = {}) {
  Flags f;
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      std::string k = a.substr(2);
      auto eq = k.find('=');
      if (eq != std::string::npos) {
        f.values[k.substr(0, eq)] = k.substr(eq + 1);
      } else if (std::find(boolean.begin(), boolean.end(), k) != boolean.end()) {
        f.values[k] = "true";
      } else if (i + 1 < argc) {
        f.values[k] = argv[++i];
      } else {
        f.error = "flag --" + k + " needs a value";
      }
    } else {
      f.positional.push_back(a);
    }
  }
  return f;
}

// The Config of a ParamCast tool: the YAML file of --config, then --endpoint
// and --model-size on top. On any error, prints it prefixed with `tool` and
// returns nothing.
inline std::optional<Config> load_tool_config(const Flags& flags, const char* tool) {
  auto cfg = load_config_file(flags.get("config"));
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s: %s\n", tool, cfg.status().message().c_str());
    return std::nullopt;
  }
  Config config = cfg.value();
  if (flags.has("endpoint")) config.control.endpoint = flags.get("endpoint");
  if (flags.has("model-size")) {
    auto bytes = parse_size(flags.get("model-size"));
    if (!bytes) {
      std::fprintf(stderr, "%s: bad --model-size '%s'\n", tool, flags.get("model-size").c_str());
      return std::nullopt;
    }
    config.trainer.model_bytes = *bytes;
  }
  return config;
}

}  // namespace paramcast
