#include "tests/support/process.h"

#include <signal.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "paramcast/build_config.h"
#if PARAMCAST_HAVE_NCCL
#include "common/data/nccl/nccl_factory.h"
#endif

extern char** environ;

namespace paramcast::test {

std::unique_ptr<Process> Process::start(const std::string& path, const std::vector<std::string>& args,
                                        const std::vector<std::string>& env) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return nullptr;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  std::vector<std::string> argv_s = {path};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) env_s.push_back(*e);
  env_s.insert(env_s.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::unique_ptr<Process> p(new Process());
  if (posix_spawn(&p->pid_, path.c_str(), &fa, nullptr, argv.data(), envp.data()) != 0) {
    posix_spawn_file_actions_destroy(&fa);
    close(fds[0]);
    close(fds[1]);
    return nullptr;
  }
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  p->fd_ = fds[0];
  Process* raw = p.get();
  p->reader_ = std::thread([raw] {
    char buf[4096];
    for (;;) {
      ssize_t n = read(raw->fd_, buf, sizeof buf);
      if (n <= 0) break;
      std::lock_guard<std::mutex> lock(raw->mu_);
      raw->out_.append(buf, static_cast<size_t>(n));
    }
  });
  return p;
}

Process::~Process() {
  if (running()) {
    ::kill(pid_, SIGKILL);
    wait_for(std::chrono::seconds(10));
  }
  if (reader_.joinable()) reader_.join();
  if (fd_ >= 0) close(fd_);
}

bool Process::running() {
  if (code_) return false;
  int st;
  if (waitpid(pid_, &st, WNOHANG) == pid_) {
    code_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (reader_.joinable()) reader_.join();  // the pipe is at EOF: all output is in
    return false;
  }
  return true;
}

std::optional<int> Process::wait_for(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (running()) {
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return code_;
}

bool Process::wait_for_output(const std::string& needle, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (output().find(needle) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

void Process::kill(int sig) {
  if (running()) ::kill(pid_, sig);
}

std::string Process::output() {
  std::lock_guard<std::mutex> lock(mu_);
  return out_;
}

// Next to the running test binary first (a packed folder, tests/gpu/pack.sh),
// else the build tree's bin directory.
std::string binary(const std::string& name) {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec && std::filesystem::exists(self.parent_path() / name)) return (self.parent_path() / name).string();
  return std::string(PARAMCAST_BIN_DIR) + "/" + name;
}

std::string make_temp_dir(const std::string& prefix) {
  std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  return mkdtemp(tmpl.data()) ? tmpl : std::string();
}

void remove_tree(const std::string& dir) {
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

std::string write_file(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

std::string read_when_written(const std::string& path, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  std::string line;
  for (;;) {
    std::ifstream in(path);
    std::getline(in, line);
    if (!line.empty() || std::chrono::steady_clock::now() >= until) return line;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

namespace {
bool iso8601_millis(const std::string& t) {  // YYYY-MM-DDTHH:MM:SS.mmmZ
  static const std::string shape = "dddd-dd-ddTdd:dd:dd.dddZ";
  if (t.size() != shape.size()) return false;
  for (size_t i = 0; i < t.size(); ++i) {
    const bool digit = t[i] >= '0' && t[i] <= '9';
    if (shape[i] == 'd' ? !digit : t[i] != shape[i]) return false;
  }
  return true;
}
}  // namespace

std::optional<LogLine> parse_log_line(const std::string& line) {
  if (line.size() < 2 || std::string("DIWE").find(line[0]) == std::string::npos || line[1] != ' ') return std::nullopt;
  const auto time_end = line.find(' ', 2);
  const auto member_end = line.find(": ", time_end == std::string::npos ? line.size() : time_end);
  if (time_end == std::string::npos || member_end == std::string::npos) return std::nullopt;
  LogLine l{line[0], line.substr(2, time_end - 2), line.substr(time_end + 1, member_end - time_end - 1),
            line.substr(member_end + 2)};
  if (!iso8601_millis(l.time) || l.member.empty() || l.member.find(' ') != std::string::npos) return std::nullopt;
  return l;
}

std::vector<LogLine> log_lines(const std::string& output) {
  std::vector<LogLine> out;
  size_t at = 0;
  while (at < output.size()) {
    auto end = output.find('\n', at);
    if (end == std::string::npos) end = output.size();
    if (auto l = parse_log_line(output.substr(at, end - at))) out.push_back(std::move(*l));
    at = end + 1;
  }
  return out;
}

int cuda_devices() {
#if PARAMCAST_HAVE_NCCL
  return nccl_backend::cuda_device_count();
#else
  return 0;
#endif
}

}  // namespace paramcast::test
