// Tiny flag parsing shared by the command-line tools: --name value / --flag.
#pragma once

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

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

}  // namespace paramcast
