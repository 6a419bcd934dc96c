// The stream (see gloo_communicator.h): joining broadcasts to it, posting
// receives within the window, forwarding chunks down the tree, taking send
// completions and completing each broadcast when its last byte left.
#include <gloo/common/error.h>

#include <algorithm>
#include <cstdint>

#include "common/data/gloo/gloo_communicator.h"
#include "common/data/gloo/schedule.h"
#include "common/log.h"
#include "common/units.h"

namespace paramcast::gloo_backend {
namespace {
constexpr auto kForever = std::chrono::hours(24 * 365);
// Per level of the tree below a rank beyond its children, the extra time it
// gives a stalled child before blaming it (stall_grace()).
constexpr auto kStallGrace = std::chrono::seconds(1);
}  // namespace

// A failure this rank saw on a pair (a receive it could not post, a send
// that failed): recorded for the runner, which explains and reports it; the
// runner is woken wherever it waits, on a receive included (the flag is
// sticky: a receive it is about to wait for returns at once).
void GlooCommunicator::report_failure_locked(Status failure) {
  if (failure_.ok() && error_.ok()) failure_ = std::move(failure);
  for (auto& op : ops_)
    if (op->in && !op->forwarded) op->in->abortWaitRecv();
  cv_.notify_all();
}

// Gives `op` its place in the stream: its chunks follow the previous
// broadcast's. Called with mu_ held, in issue order.
void GlooCommunicator::join_locked(Op& op) {
  op.first = stream_->next;
  stream_->next += op.bytes;
  op.joined = true;
}

// A stream for broadcasts from `root`: the previous one has drained. Every
// waiting broadcast with that root, in order, joins it. Runner only (the
// drainers it starts inherit its blocked SIGPIPE).
void GlooCommunicator::begin_stream_locked(int root) {
  Stream s;
  s.root = root;
  notice_root_ = root;
  s.tree = BinomialTree::of(options_.rank, options_.world_size, root);
  std::erase_if(s.tree.children, [&](int c) { return shed_.shed(c); });  // a shed child gets nothing more
  s.flight = Flight(s.tree.children, Clock::now());
  s.stall_grace = stall_grace(s.tree, root);
  stream_ = std::move(s);
  for (int c : stream_->tree.children)
    if (!drainers_.count(c)) drainers_.emplace(c, std::thread([this, c] { drain(c); }));
  for (auto& op : ops_) {
    if (op->done || op->joined) continue;
    if (op->root != root) break;
    join_locked(*op);
  }
  post_receives_locked();
}

// Posts the parent's receives this rank may hold, in stream order: a leaf
// takes every issued broadcast at once; a rank with children receives at
// most receive_window_bytes() beyond what every child took (a chunk that does
// not fit whole goes once everything before it was taken), so that its
// parent's link to it moves at the pace of its own slowest link instead of
// racing ahead (a parent that waits on this rank sees progress while the
// subtree makes it). A failure to post is the parent's pair failing: the
// runner reports it.
void GlooCommunicator::post_receives_locked() {
  if (!stream_ || stream_->tree.parent < 0 || !error_.ok() || !failure_.ok()) return;
  const Stream& s = *stream_;
  const bool leaf = s.tree.children.empty() || !s.flight.any_active();
  const uint64_t taken = leaf ? 0 : s.flight.min_taken_bytes();
  auto fits = [&](const Op& op) {
    if (leaf) return true;
    const uint64_t start = op.first + op.recvs_posted * op.chunk;
    return start <= taken || start + op.chunk_len(op.recvs_posted) <= taken + receive_window_;
  };
  try {
    for (auto& op : ops_) {
      if (op->done) continue;
      if (!op->joined) break;
      for (; op->recvs_posted < op->chunks && fits(*op); ++op->recvs_posted)
        op->in->recv(s.tree.parent, op->slot, op->recvs_posted * op->chunk, op->chunk_len(op->recvs_posted));
      if (op->recvs_posted < op->chunks) break;
    }
  } catch (const std::exception& e) {
    report_failure_locked(peer_lost(group() + "receiving from " + who(s.tree.parent) + " failed: " + e.what()));
  }
}

// The children `op` is sent to (the stream's, less those shed since), one
// send buffer each. Called with mu_ held.
void GlooCommunicator::start_locked(Op& op) {
  for (int c : stream_->tree.children) {
    if (stream_->flight.is_shed(c)) continue;
    op.children.push_back(c);
    op.out.push_back(context_->createUnboundBuffer(op.data, op.bytes));
  }
  op.started = true;
  op.start = Clock::now();
}

// Receives each chunk of `op` from the parent and posts it to every child,
// within the window. Runner only.
Status GlooCommunicator::forward(const std::shared_ptr<Op>& op) {
  try {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!op->joined) {  // another root: a new stream, once the current one drained
        cv_.wait(lock, [&] {
          return stop_ || !error_.ok() || !failure_.ok() ||
                 (ops_.front() == op && (!stream_ || stream_->flight.pending() == 0));
        });
        if (stop_ || !error_.ok()) return Status();  // fail() completed it
        if (!failure_.ok()) return failure_;
        begin_stream_locked(op->root);
      }
      start_locked(*op);
      if (!failure_.ok()) return failure_;  // posting its receives failed
    }
    for (size_t i = 0; i < op->chunks; ++i) {
      const size_t len = op->chunk_len(i);
      if (op->in) {
        const bool got = op->in->waitRecv(nullptr, kForever);
        std::lock_guard<std::mutex> lock(mu_);
        if (!got) return failure_.ok() ? aborted("broadcast interrupted") : failure_;
        links_[static_cast<size_t>(op->parent)].bytes_received += len;
      }
      if (op->children.empty()) continue;
      std::unique_lock<std::mutex> lock(mu_);
      Flight& flight = stream_->flight;
      cv_.wait(lock, [&] { return !error_.ok() || !failure_.ok() || flight.window_open(kWindowBytes); });
      if (!failure_.ok()) return failure_;
      if (!error_.ok()) return aborted("broadcast interrupted");
      for (size_t j = 0; j < op->children.size(); ++j)
        if (!flight.is_shed(op->children[j])) op->out[j]->send(op->children[j], op->slot, i * op->chunk, len);
      op->owed += flight.posted(len, Clock::now(), op->seq);
      cv_.notify_all();  // a drainer may be idle
    }
  } catch (const ::gloo::IoException& e) {
    return peer_lost(group() + "broadcast failed (a connection to a peer broke): " + e.what());
  } catch (const std::exception& e) {
    return internal_error(std::string("gloo broadcast failed: ") + e.what());
  }
  std::lock_guard<std::mutex> lock(mu_);
  op->forwarded = true;
  complete_if_done_locked(*op);
  cv_.notify_all();
  return Status();
}

// Takes the send completions to `child`, oldest chunk first, for as long as
// the communicator lives. A kick (after a failure) sends it back to waiting
// for stop_; a failed pair is reported to the runner and ends it.
void GlooCommunicator::drain(int child) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    uint32_t seq = 0;
    cv_.wait(lock, [&] {
      return stop_ || (error_.ok() && failure_.ok() && stream_ && stream_->flight.oldest(child, &seq));
    });
    if (stop_) return;
    std::shared_ptr<Op> op = find_locked(seq);
    ::gloo::transport::UnboundBuffer* buffer = op ? op->out_to(child) : nullptr;
    if (!buffer) {  // cannot happen: a pending chunk's broadcast is live until it is taken
      report_failure_locked(internal_error(group() + "a chunk owed to " + who(child) + " belongs to no live broadcast"));
      return;
    }
    lock.unlock();
    bool taken = false;
    std::string broke;
    try {
      taken = buffer->waitSend(nullptr, kForever);
    } catch (const std::exception& e) {
      broke = e.what();
      if (broke.empty()) broke = "connection failed";
    }
    lock.lock();
    if (!broke.empty()) {
      if (stream_->flight.is_shed(child)) {
        // It learnt it was shed (the notice overtakes chunks of broadcasts it
        // had not issued yet) and closed: Gloo let go of those sends with the
        // pair, so what it was owed is dropped and the others go on.
        for (const auto& c : stream_->flight.drop(child))
          if (auto o = find_locked(c.op)) {
            --o->owed;
            complete_if_done_locked(*o);
          }
        PC_DEBUG(group() << who(child) << " closed after it was shed: " << broke);
        post_receives_locked();
        cv_.notify_all();
        return;
      }
      // The child closed (after a goodbye: it left while a broadcast still
      // needed it) or the connection broke.
      report_failure_locked(
          sentinels_.said_goodbye(child)
              ? aborted(group() + who(child) + " left the group before taking a broadcast of " +
                        format_bytes(op->bytes) + " (it took " +
                        format_bytes(stream_->flight.child(child)->taken_bytes) + " of the stream)")
              : peer_lost(group() + "sending to " + who(child) + " failed: " + broke));
      return;
    }
    if (!taken) continue;  // kicked: a failure, the wait above holds until stop_
    const auto t = stream_->flight.taken(child, Clock::now());
    auto& link = links_[static_cast<size_t>(child)];
    link.bytes_sent += t.bytes;
    link.send_busy += t.busy;
    --op->owed;
    complete_if_done_locked(*op);
    post_receives_locked();
    cv_.notify_all();
  }
}

// A broadcast received and forwarded whose last send was taken completes:
// no Gloo I/O touches its memory any more. Called with mu_ held.
void GlooCommunicator::complete_if_done_locked(Op& op) {
  if (op.done || !op.forwarded || op.owed) return;
  op.done = true;
  std::erase_if(ops_, [&](const std::shared_ptr<Op>& o) { return o.get() == &op; });
  op.state->complete(Status());
}

std::shared_ptr<GlooCommunicator::Op> GlooCommunicator::find_locked(uint32_t seq) const {
  for (const auto& op : ops_)
    if (op->seq == seq) return op;
  return nullptr;
}

// A broadcast, send or receive issued and not complete.
bool GlooCommunicator::busy_locked() const {
  for (const auto& [key, queue] : p2p_)
    for (const auto& op : queue)
      if (!op->done) return true;
  return std::any_of(ops_.begin(), ops_.end(), [](const std::shared_ptr<Op>& op) { return !op->done; });
}

// The peers this rank's pending work depends on: the stream's parent and
// children, less the children this rank shed (their connections end on
// purpose), and the peers of its pending sends and receives (p2p.cc). A
// connection to one of them that ends without a word is that peer's
// failure (the watcher, cause_of). Called with mu_ held.
std::vector<int> GlooCommunicator::stream_peers_locked() const {
  std::vector<int> peers;
  if (stream_) {
    peers = stream_->tree.peers();
    std::erase_if(peers, [&](int p) { return shed_.shed(p); });
  }
  for (const auto& [key, queue] : p2p_)
    if (std::any_of(queue.begin(), queue.end(), [](const std::shared_ptr<P2p>& op) { return !op->done; }) &&
        std::find(peers.begin(), peers.end(), key.first) == peers.end())
      peers.push_back(key.first);
  return peers;
}

// A rank at height h (h levels of the tree below it) waits (h-1) grace
// steps beyond the stall window before it blames a child: a link stalled
// deeper down starves every link above it, and the rank right above the
// stall must be the one that names it.
Clock::duration GlooCommunicator::stall_grace(const BinomialTree& tree, int root) const {
  int height = 0;
  std::vector<std::pair<int, int>> todo;
  for (int c : tree.children) todo.push_back({c, 1});
  while (!todo.empty()) {
    auto [rank, depth] = todo.back();
    todo.pop_back();
    height = std::max(height, depth);
    for (int c : BinomialTree::of(rank, options_.world_size, root).children) todo.push_back({c, depth + 1});
  }
  return height > 1 ? kStallGrace * (height - 1) : Clock::duration(0);
}

// Shedding (publisher.on_slow_member: shed; shed.h): the children of the
// stream that are leaves of its tree, have work waiting, and whose link ran
// below the floor over the last window of busy time. Each is shed: nothing
// more is posted to it (what it is owed still drains, so its memory is
// released only once Gloo is done with it), the window and later broadcasts
// go on without it, and LinkStats says so. Called with mu_ held.
std::vector<int> GlooCommunicator::shed_locked(Clock::time_point now) {
  Stream& s = *stream_;
  std::vector<int> out;
  for (int c : s.tree.children) {
    const Flight::Child* fc = s.flight.child(c);
    if (!fc || fc->shed || fc->pending.empty()) continue;
    if (!BinomialTree::of(c, options_.world_size, s.root).children.empty()) continue;  // leaves only
    const auto& link = links_[static_cast<size_t>(c)];
    const auto busy = link.send_busy + (now - fc->last_progress);
    const auto v = shed_.observe(c, link.bytes_sent, std::chrono::duration_cast<Clock::duration>(busy));
    if (!v.shed) continue;
    s.flight.mark_shed(c);
    links_[static_cast<size_t>(c)].shed = true;
    PC_WARN(group() << "shedding " << who(c) << ": its link ran at " << format_rate(v.rate) << " over "
                    << format_duration(v.over) << " of busy time, below the floor of "
                    << format_rate(options_.shed_floor)
                    << " (publisher.on_slow_member: shed); the others go on without it");
    out.push_back(c);
  }
  if (!out.empty()) {
    post_receives_locked();  // a rank whose children are all shed takes the rest at once
    cv_.notify_all();        // the window may be open now
  }
  return out;
}

}  // namespace paramcast::gloo_backend
