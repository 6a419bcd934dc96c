// ControlServer: the publisher's end of the control channel.
//
// It owns the ROUTER socket and the thread that polls it: framing and decode
// limits, authentication (CURVE keys checked by its ZapHandler; every message
// must come from the key bound to the worker id it claims), peer identity
// (the probe handshake that tells a restart from a duplicate; routing
// identities "probe/<id>/<nonce>" and "member/<id>/<nonce>", one fresh nonce
// per connection, no handover), heartbeats both ways, liveness, the bounded
// membership table (departed members pruned) and StatusRequest answers. It knows nothing of tensors, plans or groups: every
// other message of a live member goes to the Listener, and the owner sends
// its own messages through send().
//
// Threads: the control thread owns the socket and calls the Listener (never
// while holding the server's lock, so a Listener may call back into the
// server). Every other method may be called from any thread; sends are queued
// and the control thread is woken through an eventfd. The server's lock is a
// leaf: it is never held while calling out.
//
// The room's files: control_server (this), control_admission.cc (Hello,
// probes, Welcome/Reject; count mode keeps a membership slot for each
// trainer rank of a many-sender job); control_client (the subscriber's end:
// DEALERs and their thread, probe -> join, heartbeats, publisher-loss
// detection, rejoin on fresh connections with backoff); auth (CURVE keys,
// authorized-keys files, the ZAP handler; docs/security.md); log_guard
// (escaping of peer strings; log rate limits per kind of event and in all,
// never per peer: ControlServer::log_peer); codec (one Envelope per frame,
// text limits); messages.h; wakeup (eventfd); member_event.h.
#pragma once

#include <zmq.hpp>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/control/auth.h"
#include "common/control/log_guard.h"
#include "common/control/loop_pause.h"
#include "common/control/codec.h"
#include "common/control/member_event.h"
#include "common/control/wakeup.h"
#include "common/status.h"
#include "common/tensor.h"

namespace paramcast::control {

using Clock = std::chrono::steady_clock;

struct ServerOptions {
  ControlOptions control;
  // Admission: these ids only, or (when empty) up to `subscriber_count` of any id.
  std::vector<std::string> subscriber_ids;
  int subscriber_count = 1;
  // Count mode: ids with a slot of their own among subscriber_count (a
  // many-sender job's trainer ranks), never taken by another id.
  std::vector<std::string> reserved_ids;
  Backend backend = Backend::kGloo;  // reported in StatusReply
  AuthOptions auth;                  // curve: key files (read by start())
};

// A routing identity as the control channel names it.
struct Route {
  enum class Kind { kOther, kProbe, kMember } kind = Kind::kOther;
  std::string id;  // the worker id it carries (probe and member kinds)
};
Route parse_route(const std::string& routing_id);

// One row of the membership table, as a snapshot.
struct Member {
  std::string id;
  uint64_t incarnation = 0;
  std::string route;  // routing identity of its member connection
  std::string host;
  std::string host_identity;  // Hello's hostIdentity (bounded, printable), or empty
  uint32_t pid = 0;
  Device device;
  Clock::time_point last_seen;
  uint64_t weight_version = 0;
  proto::WeightState state = proto::WeightState::EMPTY;
  uint64_t dirty_version = 0;
  // From its last heartbeat (round tracking, schemas/control.capnp Heartbeat).
  uint64_t ack_seq = 0;
  uint64_t plan_version = 0;
  uint64_t answered_version = 0;
  uint64_t commit_version = 0;
  uint64_t applied_version = 0;
  // Progress of the update it is receiving (heartbeats), and since when.
  uint64_t receiving_version = 0;
  uint64_t received_bytes = 0;
  Clock::time_point receiving_since;
  // Its last Applied: version, outcome, bytes received, receive time.
  uint64_t last_update_version = 0;
  bool last_update_ok = false;
  uint64_t last_update_bytes = 0;
  uint64_t last_update_ms = 0;
  uint64_t last_update_link_rate = 0;  // bytes/s, as its parent measured
  int rank = -1;  // in the current group; -1 when not in it
  bool lost = false;
  bool delta = false;  // announced the "delta" capability: it can apply delta updates
  bool source = false;  // announced "source": a trainer rank of a many-sender job (PublisherRank)
  bool link_check = false;  // announced "link_check": it answers LinkCheck (common/group/link_check.h)
  uint64_t delta_base = 0;  // the version it can apply a delta onto now (Hello, heartbeats, Applied)
};

class ControlServer {
 public:
  class Listener {
   public:
    virtual ~Listener() = default;
    // A message from a live member other than Hello, Leave and StatusRequest
    // (those the server handles); heartbeats come here too, after the
    // membership table took them in. May throw kj::Exception on a malformed
    // body: the frame is then counted as dropped.
    virtual void on_member_message(const std::string& id, proto::Envelope::Reader envelope) = 0;
    // Joined, rejoined, lost or left. `rank` is the member's rank in the
    // current group when the event happened (-1: not in it).
    virtual void on_member_event(const MemberEvent& event, int rank) = 0;
  };

  explicit ControlServer(ServerOptions options);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  // Binds the endpoint and starts the control thread.
  Status start(Listener* listener);
  // Tells every live member to leave (`reason`), flushes, and joins the thread.
  void stop(const std::string& reason);

  std::string endpoint() const { return endpoint_; }
  uint64_t incarnation() const { return incarnation_; }

  // Queues one frame to a member (any routing identity) and wakes the thread.
  // Returns the seq of the last heartbeat queued before it: a member whose
  // heartbeat acknowledges a higher seq has received the frame, unless it
  // was lost (frames to one member leave in the order they were queued).
  uint64_t send(const std::string& id, zmq::message_t frame);
  uint64_t send_to(const std::vector<std::string>& ids, const zmq::message_t& frame);

  // What StatusReply and heartbeats report; set by the owner.
  void set_epoch(uint64_t epoch) { epoch_ = epoch; }
  void set_published_version(uint64_t version) { published_version_ = version; }
  // Delta figures `paramcast status` shows (publisher.delta, the baseline,
  // the last update's tensor and wire bytes).
  struct DeltaFigures {
    std::string mode;
    uint64_t baseline_bytes = 0, baseline_version = 0, last_bytes = 0, last_wire_bytes = 0;
  };
  void set_delta_figures(DeltaFigures f) {
    std::lock_guard<std::mutex> lock(mu_);
    delta_ = std::move(f);
  }
  uint64_t epoch() const { return epoch_; }

  // Gives `group[i]` rank i + 1 and every other member rank -1.
  void assign_ranks(const std::vector<std::string>& group);

  // What a member reported in Applied: `version` held consistently, or dirty.
  void set_member_weights(const std::string& id, uint64_t version, proto::WeightState state, uint64_t delta_base = 0);
  // Records a member's Applied figures for `paramcast status`.
  void set_member_last_update(const std::string& id, uint64_t version, bool ok, uint64_t bytes, uint64_t ms);
  // Its inbound link's rate in that update (bytes/s), once the publisher
  // worked it out; ignored unless `version` is its last update.
  void set_member_link_rate(const std::string& id, uint64_t version, uint64_t link_rate);

  std::vector<std::string> live_ids() const;
  // The live ids and the generation of the membership they were read at:
  // every MemberEvent up to that generation is reflected in them.
  struct Live {
    std::vector<std::string> ids;
    uint64_t generation = 0;
  };
  Live live() const;
  bool is_live(const std::string& id) const;
  // Who the deployment still waits for: listed ids that are absent or lost,
  // or placeholders for the count not yet present.
  std::vector<std::string> missing() const;
  std::optional<Member> member(const std::string& id) const;
  // Every row of the membership table (live, lost and departed), as a snapshot.
  std::vector<Member> members() const;
  uint64_t dropped_frames() const { return dropped_frames_; }
  // Counts a refused frame from `peer` and logs why, a few lines per peer
  // and window (with the number held back); `why` must be printable already.
  void note_dropped(const std::string& peer, const std::string& why);
  // Logs a line a peer caused (`line` printable already): at most a few per
  // `kind` and window, and a few more of all kinds together, whichever peer
  // or identity sent them; the next line of a kind says how many were held back.
  void log_peer(const char* kind, const std::string& line);
  // Rows of the membership table (live and departed), for tests of its bound.
  size_t table_size() const;
  // Most departed members remembered (the oldest are pruned first).
  static constexpr size_t kMaxDeparted = 64;

  // For the fuzzer and tests: one inbound frame from `peer`, on this thread,
  // as if authenticated as `user` (curve mode; empty: no key).
  void inject(const std::string& peer, const void* data, size_t size, const std::string& user = "");

 private:
  // Who sent a frame, as the transport vouches for it.
  struct Sender {
    std::string peer;         // routing identity
    Route route;
    std::string user;         // CURVE: the User-Id its key is bound to
    std::string fingerprint;  // CURVE: its key's fingerprint
  };
  struct PendingProbe {
    std::string peer;
    std::string id;
    uint64_t incarnation;
    Clock::time_point arrived;
    std::string who;
  };
  // What dispatch decided to tell the listener, delivered after the lock is released.
  struct Deliveries {
    std::vector<std::pair<MemberEvent, int>> events;
    bool message = false;
  };

  void loop();
  void receive_burst();
  void flush_outbox();
  void handle(const Sender& from, const zmq::message_t& payload);
  bool authorized(const Sender& from, proto::Envelope::Reader envelope);
  Deliveries dispatch_locked(const Sender& from, proto::Envelope::Reader envelope);
  void hello_locked(const Sender& from, uint64_t incarnation, proto::Hello::Reader hello, Deliveries& out);
  void admit_locked(const Sender& from, uint64_t incarnation, proto::Hello::Reader hello, Deliveries& out);
  void welcome_probe_locked(const std::string& peer, const std::string& id, uint64_t incarnation);
  void settle_probes();
  void prune_locked(Clock::time_point now);
  void queue_locked(const std::string& id, zmq::message_t frame);
  void check_liveness(Clock::time_point now);
  void excuse_pause(Clock::duration paused, Clock::time_point now);
  bool has_free_slot_locked(const std::string& id) const;
  void welcome_locked(const std::string& peer, uint64_t incarnation, bool probe);
  void reject_locked(const std::string& peer, uint64_t target, proto::RejectCode code, const std::string& text,
                     uint32_t peer_version = 0);
  void status_reply_locked(const std::string& peer, uint64_t request_id);
  void deliver(const Deliveries& d, const std::string& id, proto::Envelope::Reader envelope);
  MemberEvent event_locked(MemberEvent::Kind kind, const std::string& id, std::string detail);

  const ServerOptions opt_;
  const uint64_t incarnation_;
  zmq::context_t ctx_;
  ServerAuth auth_;                  // set by start()
  std::unique_ptr<ZapHandler> zap_;  // curve mode; before router_ so that it outlives it
  zmq::socket_t router_;
  std::string endpoint_;
  Wakeup wake_;
  Listener* listener_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<uint64_t> published_version_{0};
  std::atomic<uint64_t> dropped_frames_{0};

  std::mutex log_mu_;  // guards log_limit_; a leaf lock
  LogLimiter log_limit_{5, std::chrono::seconds(10), 20};

  mutable std::mutex mu_;  // guards everything below; a leaf lock
  std::map<std::string, Member> members_;
  uint64_t generation_ = 0;  // counts membership events (MemberEvent::generation)
  std::vector<PendingProbe> probes_;
  // Worker id -> incarnation whose probe was answered, and when: the member
  // connection's Hello is taken only after its probe.
  std::map<std::string, std::pair<uint64_t, Clock::time_point>> probed_;
  std::deque<std::pair<std::string, zmq::message_t>> outbox_;
  uint64_t beat_seq_ = 0;  // heartbeat rounds queued so far (Heartbeat.seq)
  Clock::time_point pause_logged_{};  // the last warning of the control thread's own pause
  DeltaFigures delta_;
};

}  // namespace paramcast::control
