#include "common/data/gloo/mesh.h"

#include <gloo/transport/pair.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace paramcast::gloo_backend {

namespace {

using Millis = std::chrono::milliseconds;
constexpr Millis kPoll(50);  // how often a wait looks at Store::cancelled
// Once a pair failed, how long the others still get: pairs with healthy peers
// connect in milliseconds, and the failure is reported without waiting out
// the deadline for a pair that waits on the peer that failed.
constexpr Millis kAfterFailure(1000);

// This rank's address records with the bytes Gloo never initialised zeroed
// (one record per peer: a sockaddr_storage of which only the family's length
// is set, then a sequence number), so the store holds only defined bytes.
std::string defined_bytes(const std::vector<char>& data, size_t record) {
  std::string out(data.begin(), data.end());
  if (record < sizeof(sockaddr_storage)) return out;
  for (size_t at = 0; at + record <= out.size(); at += record) {
    sockaddr_storage ss;
    std::memcpy(&ss, out.data() + at, sizeof ss);
    size_t used = ss.ss_family == AF_INET ? sizeof(sockaddr_in) : ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : 0;
    if (ss.ss_family == AF_INET) std::memset(reinterpret_cast<sockaddr_in*>(&ss)->sin_zero, 0, sizeof(sockaddr_in::sin_zero));
    std::memset(reinterpret_cast<char*>(&ss) + used, 0, sizeof ss - used);
    std::memcpy(out.data() + at, &ss, sizeof ss);
  }
  return out;
}

Millis left(Deadline deadline) {
  return std::max(Millis(1), std::chrono::duration_cast<Millis>(deadline - Clock::now()));
}

// Below this much connect time before the deadline, a pair still connecting
// is no evidence against its peer (its address came late, not its peer's
// link): it is cut short, not unreachable.
constexpr Millis kMinConnect(1000);

// A rank whose mesh failed keeps its pairs open a little longer before they
// close: a peer still finishing its connect to this rank would otherwise see
// "connection closed by peer" and report this rank as unreachable, naming a
// member that only gave up because of a third one.
constexpr Millis kLinger(3000);
void linger(std::shared_ptr<::gloo::transport::Context> context, Deadline deadline) {
  const auto until = std::min(deadline, Clock::now() + kLinger);
  if (Clock::now() >= until) return;
  try {
    std::thread([context = std::move(context), until]() mutable {
      std::this_thread::sleep_until(until);
      context.reset();
    }).detach();
  } catch (const std::exception&) {  // no thread to spare: the pairs close now
  }
}

// The pair threads' outcomes, under one lock.
struct Pairs {
  // kClosed: still connecting at the deadline after a fair try (unreachable);
  // kCutShort: still waiting or connecting when the wait ended for another
  // reason, or connecting for too short a time (no evidence).
  enum State { kIdle, kWaiting, kConnecting, kConnected, kFailed, kNoAddress, kClosed, kCutShort };
  explicit Pairs(int size)
      : state(static_cast<size_t>(size), kIdle),
        why(static_cast<size_t>(size)),
        started(static_cast<size_t>(size)),
        in_connect(static_cast<size_t>(size), false) {}
  std::mutex mu;
  std::condition_variable cv;
  std::vector<State> state;
  std::vector<std::string> why;
  std::vector<Clock::time_point> started;  // when its connect began
  std::vector<bool> in_connect;            // its thread is inside Pair::connect
  int in_get = 0;                          // threads still reading the store
  std::string cancelled;                   // a get ended because the formation is over
  bool busy(size_t r) const { return state[r] == kWaiting || state[r] == kConnecting; }
  bool any(State s) const { return std::find(state.begin(), state.end(), s) != state.end(); }
};

// One peer: its address from the store (bounded by the deadline), checked,
// then the pair's connect. Runs on a thread of its own.
void connect_peer(Pairs& pairs, ::gloo::transport::Context& context, Store& store, const std::string& key, int rank,
                  int r, int size, size_t record, Deadline deadline) {
  auto value = store.get(key, left(deadline));
  std::vector<char> address;
  {
    std::lock_guard<std::mutex> lock(pairs.mu);
    --pairs.in_get;  // `store` is not touched again: connect_mesh may return
    auto& state = pairs.state[static_cast<size_t>(r)];
    if (state != Pairs::kWaiting) {  // the wait already ended
    } else if (!value.ok()) {
      if (value.status().code() == Code::kTimeout) {
        state = Pairs::kNoAddress;
      } else {
        state = Pairs::kCutShort;
        if (pairs.cancelled.empty()) pairs.cancelled = value.status().message();
      }
    } else if (value->size() != record * static_cast<size_t>(size - 1)) {  // hostile input: Gloo's size exactly
      state = Pairs::kFailed;
      pairs.why[static_cast<size_t>(r)] = "published a malformed address (" + std::to_string(value->size()) +
                                          " bytes, expected " + std::to_string(record * static_cast<size_t>(size - 1)) +
                                          ")";
    } else {
      const size_t at = static_cast<size_t>(rank > r ? rank - 1 : rank) * record;  // r's record for this rank
      address.assign(value->begin() + static_cast<std::ptrdiff_t>(at),
                     value->begin() + static_cast<std::ptrdiff_t>(at + record));
      state = Pairs::kConnecting;
      pairs.started[static_cast<size_t>(r)] = Clock::now();
      pairs.in_connect[static_cast<size_t>(r)] = true;
    }
    pairs.cv.notify_all();
    if (state != Pairs::kConnecting) return;
  }
  std::string why;
  try {
    context.getPair(r)->connect(address);
  } catch (const std::exception& e) {
    why = e.what();
  }
  std::lock_guard<std::mutex> lock(pairs.mu);
  pairs.in_connect[static_cast<size_t>(r)] = false;
  auto& state = pairs.state[static_cast<size_t>(r)];
  if (state == Pairs::kConnecting) {  // not closed meanwhile
    state = why.empty() ? Pairs::kConnected : Pairs::kFailed;
    pairs.why[static_cast<size_t>(r)] = why;
  }
  pairs.cv.notify_all();
}

// One call's mesh: the context, the pair threads and their outcomes.
class Mesh {
 public:
  Mesh(int rank, int size, const std::shared_ptr<::gloo::transport::Device>& device, Store& store,
       const std::string& prefix, Deadline deadline);
  // This rank's pair addresses in the store, under its own key.
  Status publish();
  // Every peer's thread started; an error ("": started) ends those started.
  std::string start();
  // Until every pair settled, the deadline, a failure's grace, or the
  // formation is over; returns why it is over elsewhere ("": it is not).
  std::string wait();
  void release(Pairs::State as);
  // The peers that failed into `out`, and the detail for its message.
  std::string evidence(MeshResult& out, const std::vector<std::string>& names, const std::string& cancelled);
  std::shared_ptr<::gloo::transport::Context> context() const { return context_; }

 private:
  const int rank_, size_;
  Store& store_;
  const std::string prefix_;
  const Deadline deadline_;
  const Clock::time_point began_ = Clock::now();
  std::shared_ptr<::gloo::transport::Context> context_;
  size_t record_ = 0;  // one peer's address record, in bytes
  const std::shared_ptr<Pairs> shared_;
  Pairs& pairs_;
  std::vector<std::thread> threads_;
};

Mesh::Mesh(int rank, int size, const std::shared_ptr<::gloo::transport::Device>& device, Store& store,
           const std::string& prefix, Deadline deadline)
    : rank_(rank),
      size_(size),
      store_(store),
      prefix_(prefix),
      deadline_(deadline),
      context_(device->createContext(rank, size)),
      shared_(std::make_shared<Pairs>(size)),
      pairs_(*shared_) {
  // Gloo waits 5x the pair timeout for a connect: that bound falls 1 s after
  // the deadline (this call's own verdict comes first), and ends a connect
  // this call stopped waiting for.
  context_->setTimeout(left(deadline) / 5 + Millis(200));
}

Status Mesh::publish() {
  std::vector<char> mine;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    auto& pair = context_->createPair(r);
    pair->setLocalRank(0);  // unused by the TCP transport; set so that it is defined
    const auto bytes = pair->address().bytes();
    mine.insert(mine.end(), bytes.begin(), bytes.end());
  }
  record_ = mine.size() / static_cast<size_t>(std::max(size_ - 1, 1));
  return store_.set(prefix_ + std::to_string(rank_), defined_bytes(mine, record_));
}

std::string Mesh::start() {
  try {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      {
        std::lock_guard<std::mutex> lock(pairs_.mu);
        pairs_.state[static_cast<size_t>(r)] = Pairs::kWaiting;
        ++pairs_.in_get;
      }
      try {
        threads_.emplace_back([shared = shared_, context = context_, &store = store_, key = prefix_ + std::to_string(r),
                               rank = rank_, r, size = size_, record = record_, deadline = deadline_] {
          connect_peer(*shared, *context, store, key, rank, r, size, record, deadline);
        });
      } catch (...) {
        std::lock_guard<std::mutex> lock(pairs_.mu);
        --pairs_.in_get;
        throw;
      }
    }
  } catch (const std::exception& e) {  // no thread to spare: end those started, and say so
    release(Pairs::kCutShort);
    return e.what();
  }
  return "";
}

// Settles every pair still waiting or connecting as `as`, waits for every
// thread to be done with the store (gets end by the deadline, at once when
// the formation is cancelled), then lets go of the threads: one still inside
// a connect is never interrupted (closing a pair mid-handshake can reset a
// connection its peer is accepting, and Gloo 5b14351 terminates that peer
// on the getpeername failure); it ends by Gloo's own bound (the pair
// timeout, set so that it falls at the deadline) and holds the context
// until then.
void Mesh::release(Pairs::State as) {
  std::unique_lock<std::mutex> lock(pairs_.mu);
  for (int r = 0; r < size_; ++r)
    if (pairs_.busy(static_cast<size_t>(r))) pairs_.state[static_cast<size_t>(r)] = as;
  pairs_.cv.wait(lock, [&] { return pairs_.in_get == 0; });
  lock.unlock();
  for (auto& t : threads_) t.detach();
}

std::string Mesh::wait() {
  std::string cancelled;
  bool at_deadline = false;
  std::unique_lock<std::mutex> lock(pairs_.mu);
  Deadline until = deadline_;
  bool failed = false;
  for (;;) {
    if (!pairs_.cancelled.empty()) cancelled = pairs_.cancelled;
    if (!cancelled.empty()) break;
    if (!failed && (pairs_.any(Pairs::kFailed) || pairs_.any(Pairs::kNoAddress))) {
      failed = true;
      until = std::min(deadline_, Clock::now() + kAfterFailure);
    }
    if (!pairs_.any(Pairs::kWaiting) && !pairs_.any(Pairs::kConnecting)) break;
    if (Clock::now() >= until) {
      at_deadline = until == deadline_;
      break;
    }
    pairs_.cv.wait_until(lock, std::min(until, Clock::now() + kPoll));
    lock.unlock();
    cancelled = store_.cancelled();
    lock.lock();
  }
  // At the deadline, a pair that had a fair try (kMinConnect, or half the
  // time the mesh had) is unreachable.
  const Clock::duration fair = std::min<Clock::duration>(kMinConnect, (deadline_ - began_) / 2);
  // A peer whose address is still awaited at the deadline never published it.
  if (at_deadline && cancelled.empty())
    for (int r = 0; r < size_; ++r) {
      auto& state = pairs_.state[static_cast<size_t>(r)];
      if (state == Pairs::kWaiting) state = Pairs::kNoAddress;
      if (state == Pairs::kConnecting && deadline_ - pairs_.started[static_cast<size_t>(r)] >= fair)
        state = Pairs::kClosed;
    }
  return cancelled;
}

std::string Mesh::evidence(MeshResult& out, const std::vector<std::string>& names, const std::string& cancelled) {
  auto name = [&](int r) {
    return r < static_cast<int>(names.size()) && !names[r].empty() ? names[r] : "rank " + std::to_string(r);
  };
  std::string detail;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const auto state = pairs_.state[static_cast<size_t>(r)];
    std::string what;
    switch (state) {
      case Pairs::kConnected: continue;
      case Pairs::kNoAddress:
        out.no_address.push_back(r);
        what = "its address never arrived";
        break;
      case Pairs::kFailed:
        out.unreachable.push_back(r);
        what = pairs_.why[static_cast<size_t>(r)];
        break;
      case Pairs::kClosed:
        out.unreachable.push_back(r);
        what = "not connected by the deadline";
        break;
      default:
        what = "still connecting when the wait ended";
        break;
    }
    if (!cancelled.empty() && state != Pairs::kFailed) continue;  // ended elsewhere: only what is certain
    detail += (detail.empty() ? "" : "; ") + name(r) + ": " + what;
  }
  return detail;
}

}  // namespace

MeshResult connect_mesh(int rank, int size, const std::shared_ptr<::gloo::transport::Device>& device, Store& store,
                        const std::string& prefix, Deadline deadline, const std::vector<std::string>& names) {
  MeshResult out;
  Mesh mesh(rank, size, device, store, prefix, deadline);
  if (Status s = mesh.publish(); !s.ok()) {
    out.error = "could not publish this rank's address: " + s.to_string();
    return out;
  }
  // Every peer at once: one missing address or dead peer costs the others nothing.
  if (std::string why = mesh.start(); !why.empty()) {
    out.error = "could not start the connect threads: " + why;
    return out;
  }
  const std::string cancelled = mesh.wait();
  mesh.release(Pairs::kCutShort);  // the rest: no evidence
  const std::string detail = mesh.evidence(out, names, cancelled);
  if (!detail.empty() || !cancelled.empty()) linger(mesh.context(), deadline);
  if (!cancelled.empty()) {  // another rank ended the formation; definite failures are still evidence
    out.no_address.clear();
    out.error = "group formation ended: " + cancelled + (detail.empty() ? "" : " (could not reach " + detail + ")");
    return out;
  }
  if (!detail.empty()) {
    out.error = "could not reach " + detail;
    return out;
  }
  out.context = mesh.context();
  return out;
}

}  // namespace paramcast::gloo_backend
