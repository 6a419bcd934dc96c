#include "common/data/gloo/sentinels.h"

#include <gloo/types.h>

#include <chrono>
#include <exception>

#include "common/log.h"

namespace paramcast::gloo_backend {
namespace {
// A slot no Gloo collective uses (collectives use prefixes 0x01-0x08).
constexpr uint8_t kSentinelSlotPrefix = 0x7e;
uint64_t slot() { return ::gloo::Slot::build(kSentinelSlotPrefix, 0); }
}  // namespace

Sentinels::Sentinels(::gloo::rendezvous::Context& context, int rank, int world)
    : context_(context),
      rank_(rank),
      world_(world),
      words_(static_cast<size_t>(world), 0),
      shed_words_(static_cast<size_t>(world), 0) {
  out_ = context_.createUnboundBuffer(&out_word_, sizeof(NoticeWord));
  for (int i = 0; i < world_; ++i) {
    receives_.push_back(context_.createUnboundBuffer(&words_[static_cast<size_t>(i)], sizeof(NoticeWord)));
    if (i != rank_) receives_.back()->recv(i, slot());
  }
}

void Sentinels::tell_all(NoticeWord word) {
  out_word_ = word;
  for (int i = 0; i < world_; ++i) {
    if (i == rank_) continue;
    try {
      out_->send(i, slot());
    } catch (const std::exception& e) {
      PC_DEBUG("gloo notice to rank " << i << ": " << e.what());
    }
  }
}

void Sentinels::tell_shed(int child) {
  shed_words_[static_cast<size_t>(child)] = notice_word(kShed, child);
  try {
    auto buffer = context_.createUnboundBuffer(&shed_words_[static_cast<size_t>(child)], sizeof(NoticeWord));
    buffer->send(child, slot());
    shed_out_.push_back(std::move(buffer));
  } catch (const std::exception& e) {
    PC_DEBUG("gloo shed notice to rank " << child << ": " << e.what());
  }
}

Sentinels::Notice Sentinels::first_notice() const { return first_notice({}); }

Sentinels::Notice Sentinels::first_notice(const std::function<bool(const Notice&)>& credible) const {
  for (int i = 0; i < world_; ++i) {
    if (i == rank_) continue;
    const NoticeWord w = word(i);
    if (w == 0 || w == kGoodbye) continue;
    const int blamed = static_cast<int>(w & 0xffffff) - 1;
    Notice n{i, blamed, w >> 24};
    if (blamed < 0 || blamed >= world_) n = Notice{i, i, kFailed};  // garbled: blame the sender
    if (credible && !credible(n)) continue;
    return n;
  }
  return Notice{};
}

bool Sentinels::said_goodbye(int peer) const { return word(peer) == kGoodbye; }

// A peer that wrote a word first (a goodbye, or a notice the caller reads)
// is not counted: the word completed the receive, which then never fails.
// Either precedes its end of stream on the same connection.
Sentinels::Broken Sentinels::broken(const std::vector<int>& peers, const std::set<int>& disregarded) {
  std::lock_guard<std::mutex> lock(broken_mu_);
  for (int i : peers) {
    auto& r = receives_[static_cast<size_t>(i)];
    r->abortWaitRecv();  // the wait below returns at once unless the pair failed
    try {
      r->waitRecv(nullptr, std::chrono::hours(1));
    } catch (const std::exception& e) {
      if (word(i) == 0 || disregarded.count(i)) return Broken{i, e.what()};
    }
  }
  return Broken{};
}

}  // namespace paramcast::gloo_backend
