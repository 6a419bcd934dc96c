// ControlClient: a subscriber's end of the control channel.
//
// It owns the DEALER sockets and the thread that polls them. Joining takes
// two Hellos: one from a throw-away probe identity ("probe/<id>/<nonce>"),
// which the publisher can always answer (duplicate id, unknown id, version
// mismatch), then one from the member connection ("member/<id>/<nonce>")
// that carries the membership. Every connection gets a fresh nonce. While a
// member it heartbeats and watches the publisher's heartbeats; when the
// publisher is lost, leaves or expels it, it drops its connections (a link
// that healed must not wait for an old socket's reconnect backoff), probes on
// a new one and joins again with backoff, whichever publisher answers. ZMTP
// heartbeats and TCP keepalive run on every socket; in curve mode every
// socket authenticates with the worker's key. It knows nothing of
// tensors, plans or groups: every other message goes to the Listener.
//
// Threads: the control thread owns the sockets and calls the Listener. send()
// and the setters may be called from any thread (queued, eventfd wake-up).
#pragma once

#include <zmq.hpp>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/config.h"
#include "common/control/auth.h"
#include "common/control/codec.h"
#include "common/control/loop_pause.h"
#include "common/control/wakeup.h"
#include "common/status.h"
#include "common/tensor.h"

namespace paramcast::control {

using Clock = std::chrono::steady_clock;

struct ClientOptions {
  ControlOptions control;
  std::string worker_id;
  Device device;
  // Capabilities announced in Hello ("xxh64", "callback").
  std::vector<std::string> capabilities{"xxh64"};
  // Tests only: announce another protocol version. 0: the real one.
  uint32_t protocol_version_override = 0;
  ClientAuth auth;  // curve: this worker's key pair and the publisher's public key
  // Hello's hostIdentity (empty: this member never reads shared memory).
  std::string host_identity;
  // A Reject for an id a live member holds: false, refused for good (an
  // engine's id is the deployment's to fix); true, a warning and the probe
  // again with backoff, so the member joins once the other is gone (a
  // trainer rank, whose id its rank fixes: in plain mode ids are not owned,
  // and one squatted by another process must come back to its rank).
  bool wait_out_duplicate_id = false;
};

// What Hello and heartbeats say about the subscriber's weights.
struct WeightReport {
  uint64_t version = 0;
  proto::WeightState state = proto::WeightState::EMPTY;
  uint64_t dirty_version = 0;
  // Round tracking (schemas/control.capnp Heartbeat): the latest version
  // whose Plan arrived, whose answer was queued, whose Commit arrived, whose
  // Applied was queued.
  uint64_t plan_version = 0;
  uint64_t answered_version = 0;
  uint64_t commit_version = 0;
  uint64_t applied_version = 0;
  // The update being received (0: none), and its bytes landed so far.
  uint64_t receiving_version = 0;
  uint64_t received_bytes = 0;
  // The version a delta can be applied onto now (0: none).
  uint64_t delta_base = 0;
};

class ControlClient {
 public:
  class Listener {
   public:
    virtual ~Listener() = default;
    // Welcomed as a member (again).
    virtual void on_joined() = 0;
    // The membership ended (publisher silent, left, or expelled us); the
    // client is already joining again.
    virtual void on_membership_lost(const std::string& why) = 0;
    // Refused for good (duplicate id, unknown id, version mismatch).
    virtual void on_refused(const Status& why) = 0;
    // Any other message while a member.
    virtual void on_message(proto::Envelope::Reader envelope) = 0;
    // Called on the control thread for every Hello and heartbeat.
    virtual WeightReport weight_report() = 0;
  };

  // `listener` must outlive the client.
  ControlClient(ClientOptions options, Listener* listener);
  ~ControlClient();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  void start();
  // Says Leave when a member, and joins the thread.
  void stop();

  uint64_t incarnation() const { return incarnation_; }
  bool joined() const { return joined_; }
  // The epoch stamped on heartbeats and Leave; set by the owner.
  void set_epoch(uint64_t epoch) { epoch_ = epoch; }

  // Queues a frame for the member connection (dropped while not joined).
  void send(zmq::message_t frame);

  // For the fuzzer and tests, before start(): one frame on this thread.
  void inject(const void* data, size_t size);

 private:
  enum class Phase { kProbing, kJoining, kMember };

  std::unique_ptr<zmq::socket_t> make_socket(const std::string& identity);
  void send_on(zmq::socket_t& socket, zmq::message_t frame);
  void flush_outbox();
  zmq::message_t hello_message();
  void loop();
  void poll_once();
  void receive_from(zmq::socket_t* socket);
  void after_probe_answer();
  void keep_membership(Clock::time_point now);
  void lose_membership(const std::string& why);
  void handle(const zmq::message_t& frame);
  void dispatch(proto::Envelope::Reader envelope);

  const ClientOptions opt_;
  const uint64_t incarnation_;
  Listener* const listener_;
  zmq::context_t ctx_;
  std::unique_ptr<zmq::socket_t> dealer_;  // identity = member/<id>/<nonce>; carries the membership
  std::unique_ptr<zmq::socket_t> probe_;   // identity = probe/<id>/<nonce>; only while joining
  Wakeup wake_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> joined_{false};
  std::atomic<bool> refused_{false};
  Clock::time_point duplicate_warned_{};  // the last warning of a held id (wait_out_duplicate_id)
  bool fresh_probe_ = false;              // the control thread's: probe on a new socket next time
  std::atomic<uint64_t> epoch_{0};

  // Control thread only.
  Phase phase_ = Phase::kProbing;
  bool rejoin_requested_ = false;
  std::chrono::milliseconds backoff_{100};
  uint64_t ack_seq_ = 0;  // highest publisher heartbeat seq received since joining
  Clock::time_point next_hello_, next_beat_, last_heard_;

  std::mutex mu_;  // guards outbox_; a leaf lock
  std::deque<zmq::message_t> outbox_;
};

}  // namespace paramcast::control
