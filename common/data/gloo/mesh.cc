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

// The pair threads' outcomes, under one lock.
struct Pairs {
  // kClosed: still connecting at the deadline (unreachable); kCutShort: still
  // connecting when another pair's failure ended the wait (no evidence).
  enum State { kIdle, kConnecting, kConnected, kFailed, kClosed, kCutShort };
  explicit Pairs(int size) : state(static_cast<size_t>(size), kIdle), why(static_cast<size_t>(size)) {}
  std::mutex mu;
  std::condition_variable cv;
  std::vector<State> state;
  std::vector<std::string> why;
  int running = 0;
};

}  // namespace

MeshResult connect_mesh(int rank, int size, const std::shared_ptr<::gloo::transport::Device>& device, Store& store,
                        const std::string& prefix, Deadline deadline, const std::vector<std::string>& names) {
  auto name = [&](int r) {
    return r < static_cast<int>(names.size()) && !names[r].empty() ? names[r] : "rank " + std::to_string(r);
  };
  MeshResult out;
  std::shared_ptr<::gloo::transport::Context> context = device->createContext(rank, size);
  context->setTimeout(left(deadline));  // Gloo's own bound (5x) never comes first: the deadline below does
  std::vector<char> mine;
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    auto& pair = context->createPair(r);
    pair->setLocalRank(0);  // unused by the TCP transport; set so that it is defined
    const auto bytes = pair->address().bytes();
    mine.insert(mine.end(), bytes.begin(), bytes.end());
  }
  const size_t record = mine.size() / static_cast<size_t>(std::max(size - 1, 1));
  const std::string my_key = prefix + std::to_string(rank);
  if (Status s = store.set(my_key, defined_bytes(mine, record)); !s.ok()) {
    out.error = "could not publish this rank's address: " + s.to_string();
    return out;
  }

  auto pairs = std::make_shared<Pairs>(size);
  std::vector<std::thread> threads;
  std::string cancelled;
  for (int r = 0; r < size && cancelled.empty(); ++r) {
    if (r == rank) continue;
    // Addresses still missing at the deadline are looked up once more without waiting.
    auto value = store.get(prefix + std::to_string(r), Clock::now() < deadline ? left(deadline) : Millis(1));
    if (!value.ok()) {
      if (value.status().code() != Code::kTimeout) {
        cancelled = value.status().message();
        break;
      }
      out.no_address.push_back(r);
      continue;
    }
    // Rank r's record for this rank; hostile input: the size must be exactly Gloo's.
    const size_t at = static_cast<size_t>(rank > r ? rank - 1 : rank) * record;
    if (value->size() != record * static_cast<size_t>(size - 1)) {
      std::lock_guard<std::mutex> lock(pairs->mu);
      pairs->state[r] = Pairs::kFailed;
      pairs->why[r] = "published a malformed address (" + std::to_string(value->size()) + " bytes, expected " +
                      std::to_string(record * static_cast<size_t>(size - 1)) + ")";
      continue;
    }
    std::vector<char> address(value->begin() + static_cast<std::ptrdiff_t>(at),
                              value->begin() + static_cast<std::ptrdiff_t>(at + record));
    {
      std::lock_guard<std::mutex> lock(pairs->mu);
      pairs->state[r] = Pairs::kConnecting;
      ++pairs->running;
    }
    threads.emplace_back([pairs, context, r, address = std::move(address)] {
      std::string why;
      try {
        context->getPair(r)->connect(address);
      } catch (const std::exception& e) {
        why = e.what();
      }
      std::lock_guard<std::mutex> lock(pairs->mu);
      if (pairs->state[r] == Pairs::kConnecting) {  // not closed by the deadline meanwhile
        pairs->state[r] = why.empty() ? Pairs::kConnected : Pairs::kFailed;
        pairs->why[r] = why;
      }
      --pairs->running;
      pairs->cv.notify_all();
    });
    if (cancelled.empty()) cancelled = store.cancelled();
  }

  // Every pair connected or failed, the deadline, a failure's grace, or the
  // formation is over.
  std::vector<int> closing;
  {
    std::unique_lock<std::mutex> lock(pairs->mu);
    Deadline until = deadline;
    bool failed = !out.no_address.empty();
    while (cancelled.empty() && Clock::now() < until) {
      if (!failed && std::find(pairs->state.begin(), pairs->state.end(), Pairs::kFailed) != pairs->state.end()) {
        failed = true;
        until = std::min(deadline, Clock::now() + kAfterFailure);
      }
      if (std::find(pairs->state.begin(), pairs->state.end(), Pairs::kConnecting) == pairs->state.end()) break;
      pairs->cv.wait_until(lock, std::min(until, Clock::now() + kPoll));
      lock.unlock();
      cancelled = store.cancelled();
      lock.lock();
    }
    // Close what is still connecting: its thread wakes and returns.
    const bool at_deadline = Clock::now() >= deadline;
    for (int r = 0; r < size; ++r)
      if (pairs->state[r] == Pairs::kConnecting) {
        pairs->state[r] = at_deadline && cancelled.empty() ? Pairs::kClosed : Pairs::kCutShort;
        closing.push_back(r);
      }
  }
  for (int r : closing) context->getPair(r)->close();
  for (auto& t : threads) t.join();

  if (!cancelled.empty()) {  // another rank ended the formation: no evidence from this one
    out.error = "group formation ended: " + cancelled;
    return out;
  }
  std::string detail;
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    if (std::find(out.no_address.begin(), out.no_address.end(), r) != out.no_address.end()) {
      detail += (detail.empty() ? "" : "; ") + name(r) + ": its address never arrived";
      continue;
    }
    const auto state = pairs->state[r];
    if (state == Pairs::kConnected) continue;
    if (state == Pairs::kCutShort) {
      detail += (detail.empty() ? "" : "; ") + name(r) + ": still connecting when the others had failed";
      continue;
    }
    out.unreachable.push_back(r);
    detail += (detail.empty() ? "" : "; ") + name(r) + ": " +
              (state == Pairs::kClosed ? std::string("not connected by the deadline") : pairs->why[r]);
  }
  if (!detail.empty()) {
    out.error = "could not reach " + detail;
    return out;
  }
  out.context = std::move(context);
  return out;
}

}  // namespace paramcast::gloo_backend
