# ParamCast control protocol: everything the publisher and its subscribers say
# to each other over ZeroMQ. One Envelope per ZeroMQ frame. Tensor bytes never
# travel here; they move on the data plane (NCCL or Gloo).
#
# Ordinals are never reused: retire a field by renaming it `obsoleteX`.
# See docs/protocol.md for the sequences and the framing.
@0xb4501aca07c4da4d;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("paramcast::proto");

const protocolVersion :UInt32 = 5;
# Bumped on any change that an older peer cannot understand.
# 4: the Gloo data plane's wire: broadcasts as one stream of chunks cut by
#    size and the group's stall/shed settings (common/data/gloo/schedule.h)
# 3: streamed plans (Plan.streamed, BucketLayouts), partial plans
#    (Plan.partial) and delta updates (Plan.deltaBase, BucketDelta): a
#    version-2 subscriber would misread each.
# 2: member connections are "member/<id>/<nonce>" (no longer the bare worker
#    id); a member Hello is taken only after its probe; text length limits.

enum DeviceKind {
  cpu @0;
  cuda @1;
}

enum Backend {
  gloo @0;
  nccl @1;
  shm @2;  # host memory shared by the ranks of one host (common/data/shm/)
}

enum WeightState {
  empty @0;       # no update applied yet
  consistent @1;  # holds exactly `version`
  dirty @2;       # an update began and did not finish: buffers are mixed
}

enum RejectCode {
  versionMismatch @0;  # protocol versions differ; both are in the message
  duplicateId @1;      # another live subscriber already uses this worker id
  unknownId @2;        # the deployment lists ids and this one is not among them
  notMember @3;        # sender is not (or no longer) a member: say Hello again
  staleEpoch @4;       # message names a group epoch that is not current
}

struct DeviceInfo {
  kind @0 :DeviceKind;
  # Host memory or a CUDA device.
  index @1 :Int32;
  # CUDA ordinal; 0 for cpu.
  pciBusId @2 :Text;
  # PCI bus id of the CUDA device ("" for cpu or when unknown).
}

struct Hello {
  # Sent twice on every join: first from a throw-away "probe/<id>/<nonce>"
  # identity, which the publisher can always answer (it rejects a worker id
  # that a live connection still holds), then from the member connection
  # "member/<id>/<nonce>" of the same incarnation. Nonces are fresh per
  # connection.
  protocolVersion @0 :UInt32;
  # The sender's protocolVersion constant.
  workerId @1 :Text;
  # Stable id of the subscriber (1-64 of [A-Za-z0-9._-]; "publisher" is
  # reserved); also the <id> of its routing identities.
  engineId @2 :Text;
  # Free-form id of the inference engine instance (for operators).
  host @3 :Text;
  # Host name of the subscriber process.
  pid @4 :UInt32;
  # Process id of the subscriber.
  device @5 :DeviceInfo;
  # Where the subscriber receives tensor bytes.
  capabilities @6 :List(Text);
  # Feature words, e.g. "callback" (accepts any tensor name), "xxh64".
  weightVersion @7 :UInt64;
  # Weight version the subscriber holds (0 = none).
  state @8 :WeightState;
  # Whether those weights are whole.
  dirtyVersion @9 :UInt64;
  # When dirty: the version whose update did not finish (a new publisher
  # continues above it: versions never repeat).
  deltaBase @10 :UInt64;
  # The version a delta can be applied onto now (0: none): the version
  # held, consistent, when this member can apply a delta to it (the delta
  # capability, and for a callback engine its copy at that version).
  hostIdentity @11 :Text;
  # Who shares memory with whom: the host's boot id, the user id and the
  # network namespace ("<boot id>:<uid>:net:[<inode>]"). Empty when the
  # member's data_plane.local is off. A publisher with data_plane.local:
  # auto puts members whose identity equals its own on the shm plane.
}

struct Welcome {
  protocolVersion @0 :UInt32;
  # The publisher's protocolVersion constant.
  heartbeatIntervalMs @1 :UInt32;
  # Interval at which the subscriber should send heartbeats.
  heartbeatTimeoutMs @2 :UInt32;
  # Silence after which either side declares the other lost.
  publisherIncarnation @3 :UInt64;
  # Random id of the publisher process; changes when it restarts.
  probe @4 :Bool;
  # Answer to a probe Hello (sent from a "probe/..." identity): the worker id
  # is free to use; repeat the Hello on the connection named by the worker id.
}

struct Reject {
  code @0 :RejectCode;
  # Why the message was refused.
  text @1 :Text;
  # Human-readable explanation naming what is wrong.
  publisherProtocolVersion @2 :UInt32;
  # The publisher's protocolVersion constant.
  peerProtocolVersion @3 :UInt32;
  # The protocol version the refused peer announced.
  targetIncarnation @4 :UInt64;
  # Incarnation of the process this Reject is meant for.
}

struct JoinGroup {
  rank @0 :UInt32;
  # The receiver's rank in the data-plane group; the publisher is rank 0 (root).
  worldSize @1 :UInt32;
  # Number of ranks including the publisher.
  backend @2 :Backend;
  # Data-plane backend of this group.
  bootstrap @3 :Data;
  # Backend bootstrap: an ncclUniqueId for NCCL; the store prefix for Gloo.
  members @4 :List(Text);
  # Worker id of each rank (index = rank; rank 0 is "publisher").
  initTimeoutMs @5 :UInt32;
  # Deadline for creating the communicator.
  opTimeoutMs @6 :UInt32;
  # Backstop on one collective, whatever its progress (the publisher's
  # update_timeout: no broadcast outlives its update).
  stallTimeoutMs @7 :UInt32;
  # A collective fails with TIMEOUT when a link a rank sends on makes no
  # progress for this long (data_plane.stall_timeout). 0 from an older
  # publisher: the subscriber's own setting applies.
  local @8 :List(Bool);
  # Per rank (index = rank): reads the publisher's shared memory (shm
  # plane) instead of the backend; empty: nobody does. The publisher's
  # backend group then has rank 0 and the other ranks, renumbered in order.
  localBootstrap @9 :Data;
  # The shm plane's bootstrap (its socket's name and secret), when any rank is local.
  shedFloor @10 :UInt64;
  # publisher.on_slow_member: shed (Gloo): the rate (bytes/s) below which a
  # rank sheds a child at a leaf of the tree; 0: never.
  shedWindowMs @11 :UInt32;
  # The busy time over which that rate is measured.
}

struct GroupReady {
  rank @0 :UInt32;
  # The rank whose communicator is ready.
}

struct GroupFailed {
  rank @0 :UInt32;
  # The rank that failed to create its communicator.
  reason @1 :Text;
  # What went wrong.
  unreachable @2 :List(UInt32);
  # Evidence (Gloo): the ranks this one could not connect to on the data
  # plane: refused, reset, a malformed address, or not connected within
  # init_timeout. The publisher weighs every rank's evidence to name the
  # member at fault (common/group/attribution.h), never the ones that tried
  # to reach it. At most one entry per rank of the group; others are ignored.
  noAddress @3 :List(UInt32);
  # Evidence: the ranks whose rendezvous address never arrived.
  connected @4 :Bool;
  # Every pair of its mesh connected and it failed after (Gloo's "connection
  # closed by peer" when a peer gave up): its word is that it reached every
  # peer.
}

struct LinkCheck {
  # Publisher -> a member out of the group after failed formations
  # (common/group/link_check.h): prove that your data path works, off the
  # update path, before you are tried in a formation again. Connect from
  # your data-plane address to `endpoint` (the publisher's, on its data
  # plane), send `token`, then `bytes` bytes; read `bytes` bytes back and
  # answer with their xxh64 (8 bytes, little-endian), all within timeoutMs.
  token @0 :Data;
  # 16 random bytes naming this check.
  endpoint @1 :Text;
  # "address:port" ("[address]:port" for IPv6).
  bytes @2 :UInt32;
  # Payload each way (at most 4 MiB).
  timeoutMs @3 :UInt32;
  # The whole exchange's bound (at most 60 s).
}

struct Heartbeat {
  weightVersion @0 :UInt64;
  # Weight version held (subscriber) or last published (publisher).
  state @1 :WeightState;
  # State of those weights.
  dirtyVersion @2 :UInt64;
  # When dirty: the version whose update did not finish.

  # Round tracking (docs/protocol.md, "Lost control messages"). Heartbeats and
  # update messages share one ordered connection per member, so a member that
  # acknowledges a publisher heartbeat queued after a Plan or Commit, yet
  # reports not having it, lost it; one that reports having queued an answer
  # the publisher never got lost that answer.
  seq @3 :UInt64;
  # Publisher: this heartbeat's sequence number (one per heartbeat round).
  ackSeq @4 :UInt64;
  # Subscriber: the highest publisher heartbeat seq it had received.
  planVersion @5 :UInt64;
  # Subscriber: the latest version whose Plan it received.
  answeredVersion @6 :UInt64;
  # Subscriber: the latest version whose PlanAccept/PlanReject it queued.
  commitVersion @7 :UInt64;
  # Subscriber: the latest version it was told to receive (Commit, or a
  # precommitted Plan).
  appliedVersion @8 :UInt64;
  # Subscriber: the latest version whose Applied it queued.

  # Progress of the update being received (docs/errors.md, "Slow members").
  receivingVersion @9 :UInt64;
  # Subscriber: the version whose buckets it is receiving now (0: none).
  receivedBytes @10 :UInt64;
  # Subscriber: bytes of that version landed so far.
  deltaBase @11 :UInt64;
  # Subscriber: as Hello.deltaBase, now.
}

struct Leave {
  reason @0 :Text;
  # Why the sender leaves (shutdown, fatal error).
}

struct Error {
  code @0 :UInt32;
  # A paramcast::Code value.
  text @1 :Text;
  # What went wrong, with context.
}

struct StoreSet {
  key @0 :Text;
  # Rendezvous key (already prefixed with the group epoch).
  value @1 :Data;
  # Value to store.
}

struct StoreGet {
  requestId @0 :UInt64;
  # Echoed in the StoreValue reply.
  key @1 :Text;
  # Key to read; the reply waits until the key exists.
}

struct StoreValue {
  requestId @0 :UInt64;
  # The StoreGet this answers.
  key @1 :Text;
  # The key read.
  value @2 :Data;
  # Its value.
}

struct TensorEntry {
  name @0 :Text;
  # The trainer's name of the tensor.
  dtype @1 :Text;
  # safetensors spelling: F32, BF16, F8_E4M3, ...
  shape @2 :List(Int64);
  # Dimensions, outermost first.
  nbytes @3 :UInt64;
  # Byte size (product of shape times element size).
}

struct Piece {
  tensor @0 :UInt32;
  # Index into Plan.tensors.
  tensorOffset @1 :UInt64;
  # Byte offset inside the tensor (non-zero for chunks of a large tensor).
  bucketOffset @2 :UInt64;
  # Byte offset inside the bucket.
  length @3 :UInt64;
  # Bytes of this piece.
}

struct Bucket {
  bytes @0 :UInt64;
  # Bytes moved by this bucket's broadcast.
  direct @1 :Bool;
  # One piece covering the bucket: moved straight between caller buffers.
  pieces @2 :List(Piece);
  # Where the bucket's bytes come from and go to.
}

enum ChecksumKind {
  none @0;
  xxh64 @1;
  xxh64Blocks @2;
  # XXH64 of each 4 KiB block, then XXH64 (seed = bucket bytes) of the block
  # digests: computed in parallel on a GPU (common/data/bucket_checksum.h).
}

struct Plan {
  version @0 :UInt64;
  # Weight version this update produces.
  manifestHash @1 :UInt64;
  # xxh64 of the manifest (names, dtypes, shapes), for a cross-check.
  tensors @2 :List(TensorEntry);
  # Every tensor of the update.
  buckets @3 :List(Bucket);
  # Broadcast order and layout.
  checksum @4 :ChecksumKind;
  # Per-bucket integrity check in force.
  totalBytes @5 :UInt64;
  # Sum of tensor bytes.
  precommitted @6 :Bool;
  # No PlanAccept/Commit round: every member of this epoch accepted a plan
  # with the same manifest, and the buckets follow at once. A subscriber that
  # cannot take the plan answers PlanReject, still receives every bucket
  # (dropping them: the collective must complete), and reports Applied with
  # ok = false and the rejected code; its tensors are untouched.
  streamed @7 :Bool;
  # `buckets` is empty: the trainer hands the publisher its tensors one at a
  # time (Publisher::begin_update), and the publisher lays each bucket out
  # in arrival order and announces it in BucketLayouts before its broadcast.
  bucketBytes @8 :UInt64;
  # Streamed plans: no bucket is larger (what a receiver stages at most).
  partial @9 :Bool;
  # The update carries a subset of the engines' tensors: a registered tensor
  # it does not name keeps its bytes (no missingName mismatch for it).
  deltaBase @10 :UInt64;
  # Non-zero: a delta update against this version, which every member must
  # hold, consistent (else it rejects the plan). Each bucket's BucketDelta
  # precedes its broadcast and says how the bucket travels.
  sharded @11 :Bool;
  # A many-sender update (common/reshard/): `buckets` is empty; the trainer
  # ranks in `holders` hold the tensors' bytes between them, every other
  # member of the group receives every tensor whole, and each rank derives
  # the same transfers from this plan (plan_reshard, schedule_rounds) and
  # runs its own over point-to-point moves. Each transfer is followed by the
  # xxh64 of its bytes, checked by its receiver.
  holders @12 :List(RankHoldings);
  # What each sending rank holds (ranks are the epoch's data-plane ranks).
  wanters @13 :List(RankHoldings);
  # Receiving ranks that want slices (an engine with tensor parallelism):
  # each wants exactly the regions listed. A receiving rank not listed
  # wants every tensor whole.
  shapeRef @14 :UInt64;
  # Non-zero: a sharded plan by reference, to a member that applied a plan
  # of this shape before (sharded_shape_digest, common/plan.h: its tensors,
  # holders' and wanters' regions). `tensors` and `wanters` are empty and
  # `holders` lists each holding rank with its seq and no regions; the rest
  # is the member's kept plan of that digest, checked against manifestHash
  # and totalBytes. A member that holds no plan of that digest rejects it
  # (the publisher then sends the next one whole).
}

struct HeldRegion {
  tensor @0 :UInt32;
  # Index into the Plan's (or the Holdings') tensors.
  offsets @1 :List(Int64);
  lengths @2 :List(Int64);
  # The box held, per dimension [offset, offset + length) of the full tensor.
  digest @3 :UInt64;
  digested @4 :Bool;
  # Holdings only, with data_plane.checksum set on the trainer rank: the
  # xxh64 of the box's bytes, which the publisher compares between the
  # ranks that hold the same box (replicas) before any byte moves.
}

struct RankHoldings {
  rank @0 :UInt32;
  holds @1 :List(HeldRegion);
  seq @2 :UInt64;
  # Holders: the publish call (its Holdings seq) the regions came from; the
  # trainer rank accepts the plan only during that very call.
}

struct Holdings {
  # A trainer rank (a member with the "source" capability) publishing its
  # part of the next sharded update: the full specs of the tensors it holds
  # parts of, and the regions it holds. The publisher (rank 0) plans the
  # update once every trainer rank of the group sent its Holdings.
  seq @0 :UInt64;
  # Counts this rank's publish calls (1, 2, ...), for messages.
  tensors @1 :List(TensorEntry);
  holds @2 :List(HeldRegion);
  withdrawn @3 :Bool;
  # The call of `seq` ended before an update took its part (it gave up
  # waiting): its shards may change now, and no plan may use them.
  step @4 :UInt64;
  # The training step this call publishes: the version its caller gave, or
  # its count of calls that gave none. Rank 0 pairs its own call with the
  # trainer ranks' calls of the same step only; a call of an earlier step is
  # refused (an Abandon of version 0 naming its seq), one of a later step
  # fails rank 0's call, which is behind.
  error @5 :Text;
  # Not empty: this rank cannot publish its part of step `step` (its shards
  # are refused where it runs, e.g. a transform that cannot apply to them),
  # and says why: rank 0 refuses the update at once, naming it.
  shapeRef @6 :UInt64;
  # Non-zero: this call's part by reference. The rank states the same
  # tensors and boxes as its last part sent whole, which this digest names
  # (HeldShapeDigest, common/plan.h: each tensor's name, dtype and full
  # shape, then each box); `tensors` and `holds` are empty. A rank refers
  # only to the part its previous call sent or referred to, and only when
  # that call's plan took it; rank 0 keeps each rank's last whole part (per
  # control incarnation) and refuses a reference to any other.
  digests @7 :List(UInt64);
  # With shapeRef and data_plane.checksum: the xxh64 of each box's bytes, in
  # the order of the referred part's boxes (an empty box's entry is 0 and
  # unread), or of the boxes digestBoxes names. Empty: no digests.
  digestBoxes @8 :List(UInt32);
  # With shapeRef and digests: the referred part's box of each digest, in
  # increasing order. A rank digests only the boxes that its last plan gave
  # another holder too (replicas: the only boxes rank 0 compares), so a
  # rank that shares no box sends no digest. Empty: one digest per box.
}

enum DeltaKind {
  dense @0;      # the bucket's bytes, as without a delta
  indices @1;    # changed values, then their unit indices as LEB128 gaps
  bitmask @2;    # changed values, then one bit per unit of the bucket
  unchanged @3;  # nothing changed: no broadcast
}

struct BucketDelta {
  # How one bucket of a delta update travels, sent before its broadcast.
  version @0 :UInt64;
  # Update the bucket belongs to.
  bucket @1 :UInt32;
  # Its index (broadcast order).
  kind @2 :DeltaKind;
  # Its encoding (common/delta/delta_codec.h).
  unit @3 :UInt32;
  # Bytes per compared element: the smallest element size of its tensors.
  changed @4 :UInt64;
  # Changed units carried (delta kinds).
  wireBytes @5 :UInt64;
  # Bytes broadcast for the bucket (0 when unchanged).
  pieceHashes @6 :List(UInt64);
  # The hash (pieceHash) of each piece's new bytes, in the bucket's piece
  # order: a member checks its resulting bytes against them.
  pieceHash @7 :ChecksumKind;
  # Which hash pieceHashes holds: xxh64 (host memory) or xxh64Blocks (CUDA
  # memory, computed on the device). A member whose memory checks the other
  # kind refuses the bucket (DATA_CORRUPT) before writing.
}

enum MismatchKind {
  missingName @0;     # the subscriber registered it, the plan lacks it
  unexpectedName @1;  # the plan has it, the subscriber cannot take it
  shapeMismatch @2;   # same name, different shape
  dtypeMismatch @3;   # same name, different dtype
  deviceMismatch @4;  # registered buffer is not on the data-plane device
  other @5;           # anything else; see text
}

struct Mismatch {
  kind @0 :MismatchKind;
  # What disagrees.
  name @1 :Text;
  # Tensor name.
  expected @2 :Text;
  # What the subscriber expects (its registration).
  got @3 :Text;
  # What the plan says.
}

struct PlanAccept {
  version @0 :UInt64;
  # The accepted plan's version.
  manifestHash @1 :UInt64;
  # The manifest hash the subscriber computed.
}

struct PlanReject {
  version @0 :UInt64;
  # The rejected plan's version.
  mismatches @1 :List(Mismatch);
  # Every disagreement found, not only the first.
}

struct Commit {
  version @0 :UInt64;
  # Every subscriber accepted: start receiving the plan's buckets.
}

struct Abandon {
  version @0 :UInt64;
  # The update the publisher gives up.
  reason @1 :Text;
  # Why (a rejection, a lost member, a timeout).
  holdingsSeq @2 :UInt64;
  # Version 0 (a many-sender update refused before its plan): the trainer
  # rank's publish call it ends (its Holdings seq); a call of another seq
  # goes on.
}

struct BucketChecksums {
  version @0 :UInt64;
  # Update the checksums belong to.
  first @1 :UInt32;
  # Index of the first bucket covered.
  values @2 :List(UInt64);
  # xxh64 of buckets first, first+1, ...
}

struct BucketLayouts {
  # A streamed plan's buckets, announced as the publisher seals them.
  version @0 :UInt64;
  # Update the buckets belong to.
  first @1 :UInt32;
  # Index of the first bucket listed (broadcast order).
  buckets @2 :List(Bucket);
  # Layouts of buckets first, first+1, ...; each is checked against the
  # plan's tensors and bucketBytes before its broadcast is received.
  end @3 :Bool;
  # No bucket follows: first + the length of `buckets` is the bucket count.
}

struct Applied {
  version @0 :UInt64;
  # The version the subscriber now holds, or tried to.
  ok @1 :Bool;
  # True when every byte arrived and verified.
  bytes @2 :UInt64;
  # Bytes received (landed), also when not ok.
  checksum @3 :UInt64;
  # xxh64 over the bucket checksums (0 without checksums).
  error @4 :Text;
  # When not ok: what failed (bucket, tensors, expected vs got).
  errorCode @5 :UInt32;
  # When not ok: a paramcast::Code value.
  receiveMs @6 :UInt64;
  # How long the receive took, from its first bucket issued to its last
  # landed (or its failure): bytes / receiveMs is this member's receive rate.
  deltaBase @8 :UInt64;
  # As Hello.deltaBase, after this update (its version when ok and this
  # member can take a delta onto it; 0 otherwise).
  links @7 :List(LinkFigure);
  # What this member forwarded during the update, per child in the broadcast
  # tree (backends that see their links: Gloo): its children's link rates.
}

struct LinkFigure {
  rank @0 :UInt32;
  # The child's rank in the group.
  bytes @1 :UInt64;
  # Bytes it took during the update.
  busyUs @2 :UInt64;
  # Microseconds the link had bytes waiting to be taken: bytes / busyUs is the rate
  # the link sustained, whatever its siblings did.
  shed @3 :Bool;
  # The sender shed that child (on_slow_member: shed): its link ran below the floor.
}

struct StatusRequest {
  requestId @0 :UInt64;
  # Echoed in the reply.
}

struct MemberStatus {
  workerId @0 :Text;
  # Subscriber id.
  rank @1 :Int32;
  # Rank in the current group (-1 when not in it).
  weightVersion @2 :UInt64;
  # Version it reported in its last heartbeat.
  state @3 :WeightState;
  # State it reported.
  lastHeartbeatAgeMs @4 :UInt64;
  # Time since the publisher last heard from it.
  host @5 :Text;
  # Its host.
  pid @6 :UInt32;
  # Its process id.
  device @7 :DeviceInfo;
  # Its device.
  lost @8 :Bool;
  # Declared lost (silent past the heartbeat timeout).
  receivingVersion @9 :UInt64;
  # The version it is receiving now (0: none), from its heartbeats.
  receivedBytes @10 :UInt64;
  # Bytes of that version landed so far.
  receivingForMs @11 :UInt64;
  # Since the publisher first heard it was receiving that version.
  lastUpdateVersion @12 :UInt64;
  # The last update it reported Applied for (0: none yet).
  lastUpdateOk @13 :Bool;
  # Whether that update applied.
  lastUpdateBytes @14 :UInt64;
  # Bytes it received of that update.
  lastUpdateMs @15 :UInt64;
  # How long its receive took (lastUpdateBytes / lastUpdateMs: its rate).
  lastUpdateLinkRate @16 :UInt64;
  # Bytes/s of its inbound link in that update, as its parent measured it
  # (0: not known, e.g. NCCL).
}

struct StatusReply {
  requestId @0 :UInt64;
  # The StatusRequest answered.
  epoch @1 :UInt64;
  # Current group epoch (0 before the first group).
  publishedVersion @2 :UInt64;
  # Last version fully applied by every member.
  members @3 :List(MemberStatus);
  # One row per known subscriber.
  expected @4 :UInt32;
  # Number of subscribers the deployment expects.
  backend @5 :Backend;
  # Data-plane backend.
  delta @6 :Text;
  # publisher.delta: off, auto or always.
  baselineBytes @7 :UInt64;
  # Host memory the publisher holds as the delta baseline (the model's bytes; 0 when off).
  baselineVersion @8 :UInt64;
  # The version the baseline holds (0: none yet, or the last update failed).
  lastBytes @9 :UInt64;
  # Tensor bytes of the last update.
  lastWireBytes @10 :UInt64;
  # Bytes that crossed the data plane for it (a delta: far fewer).
}

struct Envelope {
  epoch @0 :UInt64;
  # Group epoch the sender believes current (0 = none yet).
  incarnation @1 :UInt64;
  # Random id of the sending process, fixed for its lifetime.
  body :union {
    hello @2 :Hello;
    welcome @3 :Welcome;
    reject @4 :Reject;
    joinGroup @5 :JoinGroup;
    groupReady @6 :GroupReady;
    groupFailed @7 :GroupFailed;
    heartbeat @8 :Heartbeat;
    leave @9 :Leave;
    error @10 :Error;
    storeSet @11 :StoreSet;
    storeGet @12 :StoreGet;
    storeValue @13 :StoreValue;
    plan @14 :Plan;
    planAccept @15 :PlanAccept;
    planReject @16 :PlanReject;
    commit @17 :Commit;
    abandon @18 :Abandon;
    bucketChecksums @19 :BucketChecksums;
    applied @20 :Applied;
    statusRequest @21 :StatusRequest;
    statusReply @22 :StatusReply;
    bucketLayouts @23 :BucketLayouts;
    bucketDelta @24 :BucketDelta;
    holdings @25 :Holdings;
    wants @26 :Holdings;
    # An engine's slices (Subscriber::register_slice), sent when it joins and
    # when it registers one: the regions it serves of each tensor (a tensor
    # it does not list it wants whole). `seq` counts its registrations.
    linkCheck @27 :LinkCheck;
    # Publisher -> member: prove your data path works (LinkCheck).
  }
}

# A many-sender job stated by rule (common/reshard/layout.h): every tensor
# names one placement over the ranks that hold it and one over the ranks
# that want it. The tensor list travels once per job; a later update names
# it by `tensorsDigest`. (Defined and measured by the planner benchmark; the
# Plan does not carry it yet.)
struct LayoutMesh {
  parts @0 :UInt32;
  # Ranks that share each copy of a tensor.
  replicas @1 :UInt32;
  # Copies.
  ranks @2 :List(UInt32);
  # ranks[q * parts + j]: part j of copy q.
}

struct LayoutBox {
  rank @0 :UInt32;
  offsets @1 :List(Int64);
  lengths @2 :List(Int64);
  # An explicit box of a tensor, per dimension [offset, offset + length).
}

struct LayoutPlacement {
  mesh @0 :UInt32;
  # Index into JobLayoutTable.meshes (rules only).
  dim @1 :UInt32;
  # Shard(dim): torch.chunk's split of each segment over the mesh's parts.
  segments @2 :List(Int64);
  # Fused segments along dim, sizes; empty: one, the whole dim.
  boxes @3 :List(LayoutBox);
  # Non-empty: explicit boxes instead of the rule.
}

struct JobLayoutTable {
  names @0 :Data;
  # The tensors' names, front-coded: per name a LEB128 count of bytes shared
  # with the previous name, a LEB128 count of bytes that follow, the bytes.
  dtypes @1 :List(UInt8);
  # Per tensor: its DType's number (common/tensor.h).
  ranks @2 :List(UInt8);
  # Per tensor: its number of dimensions.
  dims @3 :List(Int64);
  # Every tensor's dimensions, one after the other.
  tensorsDigest @4 :UInt64;
  # xxh64 of the tensor list (names, dtypes, shapes): what a later update
  # names instead of sending the list again.
  rankNames @5 :List(Text);
  # By data-plane rank.
  meshes @6 :List(LayoutMesh);
  placements @7 :List(LayoutPlacement);
  held @8 :List(UInt32);
  # Per tensor: its placement over its holders.
  wanted @9 :List(UInt32);
  # Per tensor: its placement over its wanters, or 0xffffffff: nobody.
}
