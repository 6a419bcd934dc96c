// Status: how ParamCast reports runtime failures as values.
//
// Every operation that can fail at run time (peer gone, timeout, bad message,
// rejected plan, bad config) returns a Status or a StatusOr<T>. The code says
// what the caller should do (see docs/errors.md); the message carries the
// context (peer id, endpoint, tensor name, expected vs got). Programming bugs
// are not Statuses: they abort through PC_CHECK.
//
// Thread-safety: plain values; safe to copy across threads.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <variant>

namespace paramcast {

enum class Code {
  kOk = 0,
  kInvalidArgument,  // bad input from the caller or a file: fix the input
  kTimeout,          // a deadline passed: retry, or re-form the group
  kPeerLost,         // a peer died or was expelled: re-form the group
  kAborted,          // the operation or communicator was aborted: re-form
  kRejected,         // a peer refused (plan mismatch, duplicate id): fix the input
  kProtocol,         // malformed or unexpected message: log, drop, carry on
  kDataCorrupt,      // checksum mismatch: retry the update
  kUnavailable,      // not reachable / not started yet: retry later
  kInternal,         // a backend failed in an unclassified way
};

const char* code_name(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const;

  // Returns a copy with "context: " prepended to the message.
  Status with_context(const std::string& context) const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
inline Status timeout_error(std::string m) { return {Code::kTimeout, std::move(m)}; }
inline Status peer_lost(std::string m) { return {Code::kPeerLost, std::move(m)}; }
inline Status aborted(std::string m) { return {Code::kAborted, std::move(m)}; }
inline Status rejected(std::string m) { return {Code::kRejected, std::move(m)}; }
inline Status protocol_error(std::string m) { return {Code::kProtocol, std::move(m)}; }
inline Status data_corrupt(std::string m) { return {Code::kDataCorrupt, std::move(m)}; }
inline Status unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
inline Status internal_error(std::string m) { return {Code::kInternal, std::move(m)}; }

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  StatusOr(Status status) : v_(std::move(status)) {  // NOLINT
    if (std::get<Status>(v_).ok()) v_ = Status(Code::kInternal, "StatusOr built from an ok Status");
  }
  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() { return value(); }

 private:
  std::variant<T, Status> v_;
};

namespace detail {
[[noreturn]] void check_failed(const char* file, int line, const std::string& what);
}  // namespace detail

}  // namespace paramcast

// PC_CHECK: a programming invariant. Aborts with both operands printed.
#define PC_CHECK(cond)                                                                  \
  do {                                                                                  \
    if (!(cond)) ::paramcast::detail::check_failed(__FILE__, __LINE__, "check " #cond); \
  } while (0)

#define PC_CHECK_OP(a, op, b)                                                        \
  do {                                                                               \
    const auto& pc_a_ = (a);                                                         \
    const auto& pc_b_ = (b);                                                         \
    if (!(pc_a_ op pc_b_)) {                                                         \
      std::ostringstream pc_os_;                                                     \
      pc_os_ << "check " #a " " #op " " #b " (" << pc_a_ << " vs " << pc_b_ << ")"; \
      ::paramcast::detail::check_failed(__FILE__, __LINE__, pc_os_.str());           \
    }                                                                                \
  } while (0)
#define PC_CHECK_EQ(a, b) PC_CHECK_OP(a, ==, b)
#define PC_CHECK_LE(a, b) PC_CHECK_OP(a, <=, b)
#define PC_CHECK_LT(a, b) PC_CHECK_OP(a, <, b)

// PC_RETURN_IF_ERROR: propagate a failed Status to the caller.
#define PC_RETURN_IF_ERROR(expr)          \
  do {                                    \
    ::paramcast::Status pc_s_ = (expr);   \
    if (!pc_s_.ok()) return pc_s_;        \
  } while (0)
