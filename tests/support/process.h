// Test support: real child processes with captured output, temp dirs and
// YAML configs on ephemeral ports. Used by the multi-process tiers.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace paramcast::test {

class Process {
 public:
  // Starts `path` with `args`; `env` entries ("K=V") are added to this environment.
  static std::unique_ptr<Process> start(const std::string& path, const std::vector<std::string>& args,
                                        const std::vector<std::string>& env = {});
  ~Process();

  // Exit code (128 + signal when killed), or nullopt if still running after `timeout`.
  std::optional<int> wait_for(std::chrono::milliseconds timeout);
  bool wait_for_output(const std::string& needle, std::chrono::milliseconds timeout);
  void kill(int sig);
  bool running();
  int pid() const { return pid_; }
  std::string output();

 private:
  Process() = default;
  int pid_ = -1;
  int fd_ = -1;
  std::optional<int> code_;
  std::mutex mu_;
  std::string out_;
  std::thread reader_;
};

std::string binary(const std::string& name);  // path of a built tool
std::string make_temp_dir(const std::string& prefix);
void remove_tree(const std::string& dir);
std::string write_file(const std::string& dir, const std::string& name, const std::string& text);
// The first line of `path` once a tool wrote it there (paramcast-trainer
// --endpoint-file), or "" after `timeout`.
std::string read_when_written(const std::string& path,
                              std::chrono::milliseconds timeout = std::chrono::milliseconds(20000));
size_t count(const std::string& text, const std::string& needle);  // occurrences, overlapping ones included

// One line of a tool's log: "L YYYY-MM-DDTHH:MM:SS.mmmZ member: message".
struct LogLine {
  char level = 0;  // D, I, W or E
  std::string time, member, message;
};
// The line parsed, or nullopt where it is not a log line.
std::optional<LogLine> parse_log_line(const std::string& line);
// Every log line of a tool's output, in order.
std::vector<LogLine> log_lines(const std::string& output);
int cuda_devices();

}  // namespace paramcast::test
