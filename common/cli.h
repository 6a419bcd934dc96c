// Tiny flag parsing shared by the command-line tools: --name value / --flag.
//
// A tool describes itself with a Tool (name, usage, the flags it knows) and
// parses with parse_flags(argc, argv, first, tool): --help / -h ask for the
// usage, and a flag the tool does not know is an error. finish_flags() then
// does what every tool does with those: the usage on stdout and exit 0 for
// --help, or one error line and the usage on stderr and exit 2.
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
  std::string error;  // set when parsing failed: the first problem found
  bool help = false;  // --help or -h was given (with a Tool only)

  bool has(const std::string& k) const { return values.count(k) > 0; }
  std::string get(const std::string& k, const std::string& def = "") const {
    auto it = values.find(k);
    return it == values.end() ? def : it->second;
  }
};

// A command-line tool (or one subcommand of one): what it is called in
// messages, its usage text, and the flags it knows, without the dashes.
struct Tool {
  std::string name = {};                      // "paramcast-trainer", "paramcast status"
  std::string usage = {};                     // printed for --help and after errors; ends in '\n'
  std::vector<std::string> value_flags = {};  // --name VALUE or --name=VALUE
  std::vector<std::string> bool_flags = {};   // --name (no value)
};

namespace cli_detail {
inline bool contains(const std::vector<std::string>& v, const std::string& k) {
  return std::find(v.begin(), v.end(), k) != v.end();
}
}  // namespace cli_detail

// Permissive parsing, for internal helpers: any --name is accepted, and takes
// the next argument as its value unless `boolean` names it.
inline Flags parse_flags(int argc, char** argv, int first, const std::vector<std::string>& boolean = {}) {
  Flags f;
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      std::string k = a.substr(2);
      auto eq = k.find('=');
      if (eq != std::string::npos) {
        f.values[k.substr(0, eq)] = k.substr(eq + 1);
      } else if (cli_detail::contains(boolean, k)) {
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

// Strict parsing for a tool: only the flags `tool` names are accepted;
// --help / -h set `help`; "--" ends the flags; any other argument that starts
// with '-' is an unknown flag. Parsing goes on after an error (so that a later
// --help still counts); `error` keeps the first.
inline Flags parse_flags(int argc, char** argv, int first, const Tool& tool) {
  Flags f;
  auto fail = [&f](const std::string& why) {
    if (f.error.empty()) f.error = why;
  };
  bool only_positional = false;
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    if (only_positional || a == "-" || a.empty() || a[0] != '-') {
      f.positional.push_back(a);
    } else if (a == "--") {
      only_positional = true;
    } else if (a == "--help" || a == "-h") {
      f.help = true;
    } else if (a.rfind("--", 0) == 0) {
      std::string k = a.substr(2);
      const auto eq = k.find('=');
      const std::string name = eq == std::string::npos ? k : k.substr(0, eq);
      if (cli_detail::contains(tool.value_flags, name)) {
        if (eq != std::string::npos) {
          f.values[name] = k.substr(eq + 1);
        } else if (i + 1 < argc) {
          f.values[name] = argv[++i];
        } else {
          fail("flag --" + name + " needs a value");
        }
      } else if (cli_detail::contains(tool.bool_flags, name)) {
        f.values[name] = eq == std::string::npos ? "true" : k.substr(eq + 1);
      } else {
        fail("unknown flag --" + name);
      }
    } else {
      fail("unknown flag " + a);
    }
  }
  return f;
}

// Prints "<tool>: <error>" and the usage on stderr; returns 2, the exit code
// of a command-line mistake.
inline int usage_error(const Tool& tool, const std::string& error) {
  std::fprintf(stderr, "%s: %s\n%s", tool.name.c_str(), error.c_str(), tool.usage.c_str());
  return 2;
}

// Handles --help (usage on stdout, exit 0) and parse errors (usage_error,
// exit 2); nullopt when the tool should go on. --help wins over errors.
inline std::optional<int> finish_flags(const Flags& flags, const Tool& tool) {
  if (flags.help) {
    std::fputs(tool.usage.c_str(), stdout);
    return 0;
  }
  if (!flags.error.empty()) return usage_error(tool, flags.error);
  return std::nullopt;
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
