// The failure path (see gloo_communicator.h): the watcher that finds a
// stalled link, a peer's notice or a broken connection; fail(), which tells
// the peers, signals every pair and only then completes the Works; and the
// kicks that free every thread still inside a Gloo wait.
#include <gloo/types.h>

#include <algorithm>
#include <thread>

#include "common/data/gloo/gloo_communicator.h"
#include "common/data/gloo/sigpipe_blocked.h"
#include "common/log.h"
#include "common/units.h"

namespace paramcast::gloo_backend {
namespace {
// How often the watcher looks for failed pairs and kicks an aborted operation.
constexpr auto kWatchInterval = std::chrono::milliseconds(50);
}  // namespace

// Records the first failure, fails every issued operation with it (the
// started ones with the cause, the others as aborted), tells every peer (see
// `Notify`), then signals every pair. Idempotent; every caller returns only
// once the pairs are signalled.
void GlooCommunicator::fail(const Status& why, Notify mode, int blame, NoticeKind kind) {
  std::vector<std::pair<std::shared_ptr<data_internal::WorkState>, Status>> failed;
  bool notify = mode == Notify::kAlways;
  bool goodbye = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (mode == Notify::kIfBusy && error_.ok()) {
      notify = busy_locked();
      goodbye = !notify;
    }
    if (error_.ok()) error_ = why;
    const Status cause(error_.code(), error_.message());
    const Status pending = aborted("operation aborted: " + error_.message());
    for (auto& op : ops_) {
      if (op->done) continue;
      op->done = true;  // it stays in ops_: kicks must reach its buffers
      failed.emplace_back(op->state, op->started ? cause : pending);
    }
    for (auto& [key, queue] : p2p_)
      for (auto& op : queue) {
        if (op->done) continue;
        op->done = true;  // it stays queued: kicks must reach its buffer
        failed.emplace_back(op->state, cause);
      }
  }
  {
    std::lock_guard<std::mutex> lock(signal_mu_);
    if (!signalled_) {
      SigpipeBlocked blocked;
      if (notify || goodbye) sentinels_.tell_all(notify ? notice_word(kind, blame) : kGoodbye);
      signal_pairs();
    }
    signalled_ = true;
  }
  // Only now, with no Gloo I/O left on their memory, do the Works complete:
  // a caller woken by them may free the buffers at once.
  for (auto& [state, status] : failed) state->complete(status);
  std::lock_guard<std::mutex> lock(mu_);
  kick_locked();
  cv_.notify_all();
}

// Gloo's TCP transport signals every pair of a context when a wait times
// out; a 1 ms wait on a buffer that nothing feeds is the public way to ask
// for that (its pair header is not installed by every distribution).
void GlooCommunicator::signal_pairs() {
  char byte = 0;
  auto probe = context_->createUnboundBuffer(&byte, 1);
  try {
    probe->waitRecv(nullptr, std::chrono::milliseconds(1));
  } catch (const std::exception& e) {
    PC_DEBUG("gloo epoch " << options_.epoch << ": pairs signalled (" << e.what() << ")");
  }
}

// Wakes every Gloo wait on an operation's buffers; only after a failure.
// The flags are sticky: a thread about to wait returns at once.
void GlooCommunicator::kick_locked() {
  if (error_.ok()) return;
  for (auto& op : ops_) {
    if (op->in) op->in->abortWaitRecv();
    for (auto& b : op->out) b->abortWaitSend();
  }
  for (auto& [key, queue] : p2p_)
    for (auto& op : queue) op->send ? op->buffer->abortWaitSend() : op->buffer->abortWaitRecv();
}

// A notice only its sender's place in the broadcast tree lets it send: a
// shed only from this rank's parent, naming this rank; a stall only blaming
// one of its sender's children (the links it sends on). Anything else is a
// claim the sender cannot know, from a hostile or broken member: it must
// not get an honest rank out of the update. "" when credible.
std::string GlooCommunicator::forged_notice(const Sentinels::Notice& n) const {
  const int root = notice_root_;
  if (n.kind == kShed) {
    if (n.blamed != options_.rank)
      return who(n.from) + " sent this rank a shed notice naming " + who(n.blamed);
    const int parent = BinomialTree::of(options_.rank, options_.world_size, root).parent;
    if (parent != n.from)
      return who(n.from) + " sent a shed notice, but this rank's parent in the broadcast tree is " +
             (parent < 0 ? std::string("none (it is the root)") : who(parent)) + " (forged)";
  }
  if (n.kind == kStalled && n.blamed != n.from) {
    const auto children = BinomialTree::of(n.from, options_.world_size, root).children;
    if (std::find(children.begin(), children.end(), n.blamed) == children.end())
      return who(n.from) + " sent a stall notice blaming " + who(n.blamed) + ", which it does not send to (forged)";
  }
  return "";
}

std::set<int> GlooCommunicator::forged_senders() {
  std::lock_guard<std::mutex> lock(forged_mu_);
  return forged_;
}

Sentinels::Notice GlooCommunicator::next_notice() {
  return sentinels_.first_notice([this](const Sentinels::Notice& n) {
    const std::string why = forged_notice(n);
    if (why.empty()) return true;
    std::lock_guard<std::mutex> lock(forged_mu_);
    if (forged_.insert(n.from).second) PC_WARN(group() << why << "; ignored");
    return false;
  });
}

Status GlooCommunicator::notice_status(const Sentinels::Notice& n) const {
  if (n.kind == kShed && n.blamed == options_.rank)
    return timeout_error(group() + "this rank was shed by " + who(n.from) +
                         ": its inbound link ran below the floor of " + format_rate(options_.shed_floor) +
                         " (publisher.on_slow_member: shed); it is out of this update, the others go on");
  if (n.kind == kStalled)
    return timeout_error(group() + who(n.from) + " saw no progress for " + format_duration(options_.stall_timeout) +
                         " (stall_timeout) sending to " + who(n.blamed));
  if (n.blamed == n.from) return aborted(group() + who(n.from) + " aborted the group");
  return peer_lost(group() + who(n.blamed) + " failed (reported by " + who(n.from) + ")");
}

// The link of the stream that made no progress for its stall window, or a
// broadcast past op_timeout, as an error and the rank to blame; OK if none.
// Called with mu_ held.
std::pair<Status, int> GlooCommunicator::stalled_locked(Clock::time_point now) {
  const Stream& s = *stream_;
  const Flight::Child* slow = s.flight.slowest();
  if (slow && now - slow->last_progress > options_.stall_timeout + s.stall_grace) {
    const auto& link = links_[static_cast<size_t>(slow->rank)];
    const std::string rate = link.send_rate() > 0 ? format_rate(link.send_rate()) : "nothing yet";
    std::string waiting;
    if (auto op = find_locked(slow->pending.front().op)) waiting = " (a broadcast of " + format_bytes(op->bytes) + ")";
    return {timeout_error(group() + "no progress for " + format_duration(now - slow->last_progress) + " sending to " +
                          who(slow->rank) + waiting + " (stall_timeout " + format_duration(options_.stall_timeout) +
                          "): it took " + format_bytes(slow->taken_bytes) + " so far; that link's rate " + rate),
            slow->rank};
  }
  for (const auto& op : ops_)
    if (op->started && !op->done && now - op->start > options_.op_timeout)
      return {timeout_error(group() + "broadcast of " + format_bytes(op->bytes) + " still running after " +
                            format_duration(now - op->start) + " (the backstop, op_timeout " +
                            format_duration(options_.op_timeout) + ")"),
              options_.rank};
  return {Status(), -1};
}

// Polls for abort notices, for a stalled link of the stream, for children to
// shed and, while an operation is issued, for a broken connection to the
// stream's parent or children (Gloo never wakes a wait whose send to that
// peer is already on the wire).
void GlooCommunicator::watch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, kWatchInterval);
    if (stop_) break;
    if (error_.ok()) {
      lock.unlock();
      const auto n = next_notice();
      if (n.from >= 0) fail(notice_status(n), Notify::kNever, n.blamed);
      lock.lock();
    }
    if (error_.ok() && stream_) {
      auto [stall, blamed] = stalled_locked(Clock::now());
      if (!stall.ok()) {
        lock.unlock();
        PC_WARN(stall.message());
        fail(stall, Notify::kAlways, blamed, blamed == options_.rank ? kFailed : kStalled);
        lock.lock();
      }
    }
    if (error_.ok() && stream_ && shed_.enabled()) {
      const auto shedding = shed_locked(Clock::now());
      if (!shedding.empty()) {
        lock.unlock();
        for (int c : shedding) sentinels_.tell_shed(c);  // behind the chunks it was owed
        lock.lock();
      }
    }
    if (error_.ok() && busy_locked()) {
      const auto peers = stream_peers_locked();
      lock.unlock();
      const auto b = sentinels_.broken(peers, forged_senders());
      const auto n = next_notice();  // a notice precedes its sender's close: it explains the break
      if (n.from >= 0)
        fail(notice_status(n), Notify::kNever, n.blamed);
      else if (b.rank >= 0)
        fail(peer_lost(group() + "connection to " + who(b.rank) + " broke: " + b.what), Notify::kAlways, b.rank);
      lock.lock();
    }
    kick_locked();
  }
}

// After a failed operation: the cause, preferring a peer's notice (which
// may trail the end of stream of a peer that gave up first by a few ms),
// and the rank to blame (-1: the notice's sender already told everyone).
std::pair<Status, int> GlooCommunicator::cause_of(const Status& failure) {
  for (int i = 0; i < 10; ++i) {
    const auto n = next_notice();
    if (n.from >= 0) return {notice_status(n), -1};
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::vector<int> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers = stream_peers_locked();
  }
  const auto b = sentinels_.broken(peers, forged_senders());
  return {failure, b.rank >= 0 ? b.rank : options_.rank};
}

}  // namespace paramcast::gloo_backend
