// ParamCast's typed options and the YAML loader that fills them.
//
// Each struct documents its defaults. The loader only fills and validates
// these structs: an invalid file yields one error naming the file, line and
// column, the key path, the bad value and what was expected. Unknown keys are
// errors so that a typo never passes silently. See deploy/*.yaml for examples.
//
// Thread-safety: plain values.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/log.h"
#include "common/status.h"
#include "common/tensor.h"
#include "common/transform/transform.h"

namespace paramcast {

using Millis = std::chrono::milliseconds;

struct ControlOptions {
  // ZeroMQ endpoint the publisher binds and subscribers connect to. A port of
  // "*" binds an ephemeral port (the publisher reports the bound endpoint).
  // Default: tcp://127.0.0.1:29500
  std::string endpoint = "tcp://127.0.0.1:29500";
  // Interval of heartbeats in both directions. Default: 250ms
  Millis heartbeat_interval{250};
  // Silence after which a peer is declared lost. Default: 3s
  Millis heartbeat_timeout{3000};
  // How long start() waits for the expected subscribers. Default: 60s
  Millis join_timeout{60000};
  // Upper bound of a subscriber's reconnect backoff. Default: 2s
  Millis reconnect_backoff_max{2000};
  // Largest control message accepted; larger frames are dropped. Default: 64MiB
  uint64_t max_message_bytes = 64ull << 20;
};

enum class Backend { kGloo, kNccl, kShm };
const char* backend_name(Backend b);
// The control message's Backend for `b`, and back (unknown values: gloo).
int backend_wire(Backend b);
Backend backend_from_wire(int v);

enum class Checksum { kNone, kXxh64, kXxh64Blocks };  // see common/data/bucket_checksum.h

struct DataPlaneOptions {
  // gloo (host memory over TCP), nccl (CUDA memory), or shm (memory of the
  // publisher's host shared with engines beside it, as the same user: host
  // memory, or with CUDA devices its GPU memory through CUDA IPC, for
  // engines on the trainer's GPU). Default: gloo
  Backend backend = Backend::kGloo;
  // Address Gloo's TCP device binds (and announces to peers). Default: 127.0.0.1
  std::string gloo_hostname = "127.0.0.1";
  // Network interface for Gloo instead of a hostname, e.g. "lo". Default: unset
  std::string gloo_interface;
  // Members on the publisher's host (same boot, same user, same network
  // namespace, as each says in its Hello: never guessed from an address)
  // read the bytes from the publisher's shared memory (the shm plane) while
  // the others get them over the backend, in the same update: `auto`, or
  // `off` (everyone over the backend). With backend gloo. Set on the
  // publisher and on the members that may take part. Default: off
  bool local = false;
  // Staging bucket size; small tensors are packed into buckets of this size.
  // Default: 256MiB
  uint64_t bucket_bytes = 256ull << 20;
  // Tensors at least this large skip staging and move straight between the
  // caller's buffers. Default: 1MiB
  uint64_t direct_min_bytes = 1ull << 20;
  // Per-bucket integrity check, verified before unpack: xxh64 (sequential;
  // on CUDA hashed on the host) or xxh64-blocks (4 KiB blocks hashed in
  // parallel, on the GPU for CUDA memory; common/data/bucket_checksum.h).
  // Off by default: it costs a pass over the bytes on every rank. Default: none
  Checksum checksum = Checksum::kNone;
  // A broadcast fails with TIMEOUT when a link it moves bytes on makes no
  // progress (takes no chunk) for this long; a slow link that keeps moving
  // never fails it, however long a bucket takes (publisher.update_timeout
  // caps the whole update). The old key `timeout` is read as this one, with
  // a warning. Default: 30s
  Millis stall_timeout{30000};
  // Deadline of communicator creation (group formation). Default: 60s
  Millis init_timeout{60000};
};

enum class MemberLossPolicy { kFail, kContinue };
enum class MissingAtStartPolicy { kFail, kStartWithPresent };
enum class SlowMemberPolicy { kWait, kShed };

// Delta updates (common/delta/): what the publisher sends when every
// member holds the baseline version.
enum class DeltaMode { kOff, kAuto, kAlways };
enum class DeltaBaseline { kHost, kDevice };

struct PublisherOptions {
  // Expected subscribers: explicit ids, or a count (ids then unchecked).
  // Default: 1 subscriber, any id.
  std::vector<std::string> subscriber_ids;
  int subscriber_count = 1;
  // Trainer ranks of a many-sender job (Publisher::weight_update_sharded):
  // the publisher is rank 0, ranks 1..ranks-1 join it as members
  // "trainer-1".. (PublisherRank) beside the subscribers. Default: 1
  int ranks = 1;
  // Device holding the trainer's tensors. Default: cpu
  Device device;
  // What weight_update does after a member is lost. Default: fail
  MemberLossPolicy on_member_loss = MemberLossPolicy::kFail;
  // What start() does when join_timeout passes with subscribers missing. Default: fail
  MissingAtStartPolicy on_missing_at_start = MissingAtStartPolicy::kFail;
  // Deadline of one whole weight_update. Default: 10m
  Millis update_timeout{600000};
  // How long every member has to answer a Plan (PlanAccept/PlanReject): a
  // member that heartbeats but does not answer fails the update with
  // TIMEOUT naming it, whatever its heartbeats say. Default: 10s
  Millis plan_timeout{10000};
  // A member that failed two group formations in a row is quarantined (left
  // out of formations) for this long, twice as long for each further failure
  // (at most 16x), then tried again. Strikes follow the worker id (the key, in
  // curve mode) across restarts and rejoins; a formation it is ready in clears
  // them, and so does 32x this long without a failure. Default: 30s
  Millis quarantine_backoff{30000};
  // How long every member has to report Applied once the publisher's data
  // plane finished (its on_update_end hook included). 0 is auto, the
  // default: 8x the member's own slowest recent Applied or this update's
  // slowest so far, within [15 s, 60 s]; 60 s on the member's first
  // update (trainer_side/apply_deadline.h).
  Millis apply_timeout{0};
  // What a slow member costs the others (Gloo). wait: the broadcast moves at
  // the pace of its slowest link. shed: a member at a leaf of the broadcast
  // tree whose inbound link sustained less than slow_member_floor bytes/s
  // over slow_member_window of busy time is cut from the update (dirty, named
  // in UpdateResult::shed) and the others finish at their own pace; it is
  // back in the group for the next update, placed at a leaf. Default: wait
  SlowMemberPolicy on_slow_member = SlowMemberPolicy::kWait;
  // The rate floor for shed, in bytes per second (a size: 8MiB). Required
  // with shed.
  uint64_t slow_member_floor = 0;
  // Busy time over which a link's rate is measured against the floor.
  // Default: 5s
  Millis slow_member_window{5000};
  // Skip the plan/accept round trip when every member of the current group
  // already accepted a plan with the same manifest: the plan goes out
  // precommitted and the buckets follow at once. Each subscriber still checks
  // the plan before any byte reaches its tensors; one that cannot take it
  // receives and drops the buckets and reports the mismatches. A many-sender
  // delta plan always goes through the round (an engine that refuses it gets
  // the same version dense). Default: true
  bool reuse_validated_plan = true;
  // Delta updates: `auto` sends a bucket as the elements that changed since
  // the version every member holds when that is at most half its bytes,
  // `always` whenever it is smaller, `off` never (and keeps no baseline).
  // The baseline is a copy of the last version every member applied: the
  // whole model's bytes, in host memory (docs/ARCHITECTURE.md). YAML:
  // `delta: auto`, or `delta: {mode: auto, baseline: host}`. Default: auto
  DeltaMode delta = DeltaMode::kAuto;
  // Where a CUDA publisher's baseline lives: host (pinned memory the GPU
  // reads through unified addressing) or device (the trainer's GPU: faster,
  // costs the model's bytes there). Host tensors' baseline is host memory
  // either way. Default: host
  DeltaBaseline delta_baseline = DeltaBaseline::kHost;
  // What travels instead of the trainer's bytes, by tensor name
  // (common/transform/transform.h): a list of {match: GLOB, cast:
  // bf16|fp16|fp32}, {match: GLOB, fp8: block|channel|tensor} or {match:
  // GLOB, keep: true}; the first match decides. Default: none (every tensor
  // as it is)
  std::vector<transform::Rule> transforms;
};

struct SubscriberOptions {
  // Device per worker, by worker index (position in the id list, or N of
  // "worker-N" when subscribers is a count). One entry applies to all.
  // Default: [cpu]
  std::vector<Device> devices{Device::cpu()};
  // An engine that lands weights through a callback (on_tensor, Python
  // on_weights) needs the previous bytes to apply a delta: with `host` it
  // keeps its own copy of the last version (the model's bytes in host
  // memory) and still gets whole tensors in its callback; with `none` its
  // group gets dense updates. Engines with registered buffers apply deltas
  // in place and need no copy. Default: none
  bool delta_baseline = false;
};

// The synthetic workload of paramcast-trainer / paramcast-worker.
// How the synthetic model's bytes change from one version to the next.
enum class ModelChanges {
  kEvery,   // every byte is new at every version
  kUneven,  // as an RL step changes a model: per tensor and version, unchanged,
            // a few elements, wholesale, or wholesale in alternate 256 KiB blocks
};

struct TrainerJobOptions {
  // Approximate total bytes of the synthetic model. Default: 64MiB
  uint64_t model_bytes = 64ull << 20;
  // Decoder layers (9 tensors each; 291 tensors for 32 layers). Default: 32
  int layers = 32;
  // Element type of every tensor. Default: BF16
  DType dtype = DType::kBF16;
  // Number of weight updates to publish. Default: 5
  int updates = 5;
  // Pause between updates. Default: 0s
  Millis interval{0};
  // Seed of the reproducible content. Default: 1
  uint64_t seed = 1;
  // How the content changes between versions (`every` or `uneven`; with
  // deltas on, `uneven` makes buckets go dense, encoded and unchanged in
  // mixed orders). Default: every
  ModelChanges changes = ModelChanges::kEvery;
};

// Authentication of the control channel; see docs/security.md. File paths are
// relative to the config file's directory.
enum class AuthMode { kPlain, kCurve };
struct AuthOptions {
  // plain: anyone who reaches the endpoint may join (loopback development;
  // must be written out for any other endpoint). curve: ZeroMQ CURVE with the
  // keys below. Default: plain, allowed only on loopback endpoints
  AuthMode mode = AuthMode::kPlain;
  bool mode_given = false;
  // Publisher's key pair (read by the publisher only). Default: unset
  std::string publisher_key;
  // Publisher's public key (read by subscribers and `paramcast status`). Default: unset
  std::string publisher_public_key;
  // "<worker-id> <public key>" per line: who may join, under which id. Default: unset
  std::string authorized_keys;
  // "<name> <public key>" per line: who may read status only. Default: unset
  std::string status_keys;
  // Each subscriber's key pair; "{id}" stands for its worker id. Default: unset
  std::string worker_key;
  // Key pair `paramcast status` uses. Default: unset
  std::string status_key;
};

// Prometheus metrics over HTTP (common/metrics/): the publisher and every
// subscriber serve their figures in the text format at /metrics.
struct MetricsOptions {
  // HOST:PORT to serve on. A bare PORT or ":PORT" means 127.0.0.1 (loopback);
  // any other address only when written out. Port 0 picks a free port
  // (Publisher/Subscriber::metrics_endpoint() and the log say which).
  // Processes that share a config and a host need port 0 or their own
  // configs. Default: off
  std::string listen_host;
  int listen_port = -1;  // -1: off
  bool enabled() const { return listen_port >= 0; }
};

// A worker id: 1-64 of [A-Za-z0-9._-], not a reserved name ("publisher").
bool valid_worker_id(const std::string& id);

struct Config {
  std::string source;  // file the config came from, for messages
  ControlOptions control;
  DataPlaneOptions data_plane;
  PublisherOptions publisher;
  SubscriberOptions subscriber;
  TrainerJobOptions trainer;
  AuthOptions auth;
  MetricsOptions metrics;
  LogLevel log_level = LogLevel::kInfo;
  LogFormat log_format = LogFormat::kText;

  // Ids of the workers a deployment runs: the listed ids, or worker-1..N.
  std::vector<std::string> worker_ids() const;
  int expected_count() const;
  // Device of the worker with this id (see SubscriberOptions::devices).
  Device device_for_worker(const std::string& id) const;
};

// The worker id of trainer rank r > 0 of a many-sender job ("trainer-1").
inline std::string trainer_rank_id(int rank) { return "trainer-" + std::to_string(rank); }


StatusOr<Config> load_config_file(const std::string& path);
// `name` stands in for the file name in error messages.
StatusOr<Config> load_config_string(const std::string& yaml, const std::string& name = "<string>");

}  // namespace paramcast
