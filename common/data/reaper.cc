#include "common/data/reaper.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "common/log.h"

namespace paramcast {

struct Reaper::State {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Communicator>> queue;
  size_t busy = 0;     // queued + being destroyed
  bool closed = false;  // the Reaper is gone: the thread drains and exits
  std::thread thread;

  void loop() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return closed || !queue.empty(); });
      if (queue.empty()) return;
      std::shared_ptr<Communicator> c = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      c.reset();  // the backend's teardown, off every caller's thread
      lock.lock();
      --busy;
      cv.notify_all();
    }
  }

  void push(std::shared_ptr<Communicator> c) {
    std::unique_lock<std::mutex> lock(mu);
    if (closed) {
      lock.unlock();
      std::thread([c = std::move(c)]() mutable { c.reset(); }).detach();
      return;
    }
    ++busy;
    queue.push_back(std::move(c));
    cv.notify_all();
  }
};

namespace {

// Deleter of an adopted communicator: hands the real owner to the reaper.
struct ToReaper {
  std::shared_ptr<Reaper::State> state;
  std::shared_ptr<Communicator> owner;
  void operator()(Communicator*) { state->push(std::move(owner)); }
};

}  // namespace

Reaper::Reaper(std::chrono::milliseconds drain) : state_(std::make_shared<State>()), drain_(drain) {
  // The thread holds the state so that it outlives a Reaper it must detach from.
  state_->thread = std::thread([s = state_] { s->loop(); });
}

Reaper::~Reaper() {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->closed = true;
  state_->cv.notify_all();
  const bool drained = state_->cv.wait_for(lock, drain_, [&] { return state_->busy == 0; });
  lock.unlock();
  if (drained) {
    state_->thread.join();
  } else {
    PC_WARN("communicator teardown still running after " << drain_.count() << " ms; leaving it behind");
    state_->thread.detach();
  }
}

std::shared_ptr<Communicator> Reaper::adopt(std::unique_ptr<Communicator> comm) {
  return adopt(std::shared_ptr<Communicator>(std::move(comm)));
}

std::shared_ptr<Communicator> Reaper::adopt(std::shared_ptr<Communicator> comm) {
  if (!comm) return nullptr;
  Communicator* raw = comm.get();
  return std::shared_ptr<Communicator>(raw, ToReaper{state_, std::move(comm)});
}

size_t Reaper::pending() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->busy;
}

}  // namespace paramcast
