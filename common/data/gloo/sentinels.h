// Sentinels: how the ranks of a Gloo group tell each other why they close.
// Internal to data/gloo.
//
// Every rank posts one receive per peer, when the group forms, on a slot no
// collective uses. Before a rank closes its pairs it writes one word there
// to every peer (tell_all): the rank it blames and why, or a goodbye when it
// leaves a healthy group. The receive is already posted, so on an idle
// connection Gloo writes the word at once and it arrives ahead of the close
// (an orderly close). A peer not on the failed broadcast's path learns of
// the failure this way. The same receive fails exactly when that peer's pair
// fails without a word: a killed peer (broken()).
//
// Thread-safety: first_notice(), said_goodbye() and broken() from any thread
// (the words are written by Gloo's I/O thread and read atomically; broken()
// calls are serialized);
// tell_all() from one thread at a time (the communicator's signal lock);
// tell_shed() from one thread (the watcher).
#pragma once

#include <gloo/rendezvous/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace paramcast::gloo_backend {

// The 32-bit word: the kind in the top byte, 1 + the blamed rank below; or
// kGoodbye.
using NoticeWord = uint32_t;
constexpr NoticeWord kGoodbye = ~NoticeWord(0);
// kShed goes to one child only, the one its parent shed (shed.h).
enum NoticeKind : NoticeWord { kFailed = 0, kStalled = 1, kShed = 2 };
inline NoticeWord notice_word(NoticeKind kind, int blamed) {
  return (static_cast<NoticeWord>(kind) << 24) | (static_cast<NoticeWord>(blamed + 1) & 0xffffff);
}

class Sentinels {
 public:
  // Posts the receives; the context's pairs must be connected.
  Sentinels(::gloo::rendezvous::Context& context, int rank, int world);

  // One word to every peer; a peer whose pair already failed is skipped.
  void tell_all(NoticeWord word);
  // kShed to `child` alone, queued behind the chunks it is still owed.
  void tell_shed(int child);

  // The first peer that sent a word other than a goodbye, the rank it blamed
  // (a garbled word blames its sender) and the kind; from = -1 if none.
  struct Notice {
    int from = -1;
    int blamed = -1;
    NoticeWord kind = kFailed;
  };
  Notice first_notice() const;
  // The same, skipping notices `credible` refuses (a peer that could not
  // have sent it: data/gloo/abort.cc).
  Notice first_notice(const std::function<bool(const Notice&)>& credible) const;
  bool said_goodbye(int peer) const;

  // The first of `peers` whose connection broke without a word first, and
  // Gloo's reason; rank -1 if none. Returns at once.
  struct Broken {
    int rank = -1;
    std::string what;
  };
  // `disregarded`: peers whose word was forged (abort.cc): a word from them
  // explains nothing, so their broken connection still counts.
  Broken broken(const std::vector<int>& peers, const std::set<int>& disregarded = {});

 private:
  NoticeWord word(int peer) const { return __atomic_load_n(&words_[static_cast<size_t>(peer)], __ATOMIC_ACQUIRE); }

  ::gloo::rendezvous::Context& context_;
  std::mutex broken_mu_;  // one broken() at a time: each consumes its own abort flag
  const int rank_;
  const int world_;
  NoticeWord out_word_ = 0;
  std::unique_ptr<::gloo::transport::UnboundBuffer> out_;
  std::vector<NoticeWord> words_;  // by peer, written by Gloo
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> receives_;
  std::vector<NoticeWord> shed_words_;                                       // the kShed word to each shed child
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> shed_out_;  // Gloo may still be writing them
};

}  // namespace paramcast::gloo_backend
