// The Gloo data plane's lifecycle, public calls and runner loop; the design
// is in gloo_communicator.h, the stream in tree_schedule.cc, the failure
// path in abort.cc.
#include "common/data/gloo/gloo_communicator.h"

#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <algorithm>

#include "common/data/gloo/gloo_factory.h"
#include "common/data/gloo/mesh.h"
#include "common/data/gloo/schedule.h"
#include "common/data/gloo/sigpipe_blocked.h"
#include <cstdlib>

#include "common/log.h"

namespace paramcast::gloo_backend {
namespace {
// Gloo-level waits never time out on their own (a Gloo timeout closes every
// pair before this rank can tell its peers why); the watcher bounds them.
constexpr auto kForever = std::chrono::hours(24 * 365);
}  // namespace

GlooCommunicator::GlooCommunicator(const GroupOptions& options, std::shared_ptr<::gloo::rendezvous::Context> context)
    : options_(options),
      max_chunk_(max_chunk_bytes(options.stall_timeout, options.shed_floor, options.shed_window)),
      receive_window_(receive_window_bytes(options.stall_timeout, max_chunk_)),
      context_(std::move(context)),
      sentinels_(*context_, options.rank, options.world_size),
      links_(static_cast<size_t>(options.world_size)),
      shed_(options.world_size, options.shed_floor, options.shed_window) {
  SigpipeBlocked blocked;  // inherited by both threads (and the drainers the runner starts)
  // Test hook, a hostile member on the real transport:
  // PARAMCAST_FAULT_GLOO_FORGE="shed:R,stall:S" sends rank R a shed notice
  // and tells every peer that rank S stalled, as soon as the group formed,
  // whatever this rank's place in the tree (peers must ignore both).
  if (const char* forge = std::getenv("PARAMCAST_FAULT_GLOO_FORGE")) {
    std::string spec = forge;
    for (size_t at = 0; at < spec.size();) {
      const size_t end = std::min(spec.find(',', at), spec.size());
      const std::string item = spec.substr(at, end - at);
      const size_t colon = item.find(':');
      const int target = colon == std::string::npos ? -1 : std::atoi(item.c_str() + colon + 1);
      if (target >= 0 && target < options_.world_size && target != options_.rank) {
        if (item.rfind("shed:", 0) == 0) sentinels_.tell_shed(target);
        if (item.rfind("stall:", 0) == 0) sentinels_.tell_all(notice_word(kStalled, target));
      }
      at = end + 1;
    }
  }
  runner_ = std::thread([this] { run(); });
  watcher_ = std::thread([this] { watch(); });
}

GlooCommunicator::~GlooCommunicator() {
  fail(aborted("communicator destroyed"), Notify::kIfBusy, options_.rank);
  std::unique_lock<std::mutex> lock(mu_);
  stop_ = true;
  cv_.notify_all();
  while (!runner_done_) {
    kick_locked();
    cv_.wait_for(lock, std::chrono::milliseconds(10));
  }
  // The drainers and completers end at stop_: one inside a Gloo wait is kicked out of it
  // (the kick is sticky: one about to wait returns at once).
  kick_locked();
  std::map<int, std::thread> drainers;
  drainers.swap(drainers_);
  std::map<P2pKey, std::thread> completers;
  completers.swap(p2p_threads_);
  lock.unlock();
  for (auto& [child, t] : drainers) t.join();
  for (auto& [key, t] : completers) t.join();
  runner_.join();
  watcher_.join();
}

std::shared_ptr<Work> GlooCommunicator::broadcast(void* data, size_t bytes, int root) {
  auto work = std::make_shared<data_internal::DeadlineWork>(this, options_.epoch, options_.rank);
  if (bytes == 0) {
    work->state->complete(Status());
    return work;
  }
  if (root < 0 || root >= options_.world_size) {
    work->state->complete(invalid_argument("broadcast root " + std::to_string(root) + " is not a rank of a group of " +
                                           std::to_string(options_.world_size)));
    return work;
  }
  auto op = std::make_shared<Op>();
  op->data = static_cast<uint8_t*>(data);
  op->bytes = bytes;
  op->root = root;
  op->state = work->state;
  op->chunk = chunk_bytes_for(bytes, max_chunk_);
  op->chunks = chunk_count(bytes, op->chunk);
  op->parent = BinomialTree::of(options_.rank, options_.world_size, root).parent;
  if (op->parent >= 0) op->in = context_->createUnboundBuffer(op->data, bytes);
  SigpipeBlocked blocked;  // posting a receive writes a notice to the parent
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_.ok()) {
    work->state->complete(aborted("communicator of epoch " + std::to_string(options_.epoch) +
                                  " is unusable: " + error_.to_string()));
    return work;
  }
  op->seq = next_seq_++;
  op->slot = ::gloo::Slot::build(kChunkSlotPrefix, op->seq);
  ops_.push_back(op);
  // It joins the stream now if every broadcast before it did and the root is
  // the stream's; the runner joins it otherwise, once the stream drained.
  const bool earlier_joined = ops_.size() == 1 || ops_[ops_.size() - 2]->joined;
  if (stream_ && stream_->root == root && earlier_joined) {
    join_locked(*op);
    post_receives_locked();
  }
  cv_.notify_all();
  return work;
}

void GlooCommunicator::abort(const std::string& reason) { fail(aborted(reason), Notify::kIfBusy, options_.rank); }

Status GlooCommunicator::async_error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

std::vector<LinkStats> GlooCommunicator::link_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<LinkStats> out;
  for (size_t i = 0; i < links_.size(); ++i)
    if (links_[i].bytes_sent || links_[i].bytes_received || links_[i].shed) {
      out.push_back(links_[i]);
      out.back().peer = static_cast<int>(i);
    }
  return out;
}

std::string GlooCommunicator::who(int rank) const {
  std::string s = "rank " + std::to_string(rank);
  if (rank >= 0 && static_cast<size_t>(rank) < options_.members.size() && !options_.members[rank].empty())
    s += " (" + options_.members[rank] + ")";
  return s;
}

std::string GlooCommunicator::group() const { return "gloo group of epoch " + std::to_string(options_.epoch) + ": "; }

// Forwards the issued broadcasts in order. A failure it sees (or a drainer
// reports) is explained (cause_of) and fails the communicator; after that it
// only waits to be stopped.
void GlooCommunicator::run() {
  for (;;) {
    std::shared_ptr<Op> op;
    Status failure;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto next = [&]() -> std::shared_ptr<Op> {
        for (auto& o : ops_)
          if (!o->forwarded) return o;
        return nullptr;
      };
      cv_.wait(lock, [&] { return stop_ || (error_.ok() && (!failure_.ok() || next())); });
      if (stop_) break;
      if (!failure_.ok()) failure = failure_;
      else op = next();
    }
    if (op) failure = forward(op);
    if (failure.ok()) continue;
    bool aborted_here;
    {
      std::lock_guard<std::mutex> lock(mu_);
      aborted_here = !error_.ok();
    }
    if (aborted_here) continue;  // fail() already completed every operation
    auto [status, blame] = cause_of(failure);
    // Pairs signalled first: no Gloo I/O (a send still reading a buffer
    // towards a child) outlives the Works' completion.
    fail(status, blame >= 0 ? Notify::kAlways : Notify::kNever, blame);
  }
  std::lock_guard<std::mutex> lock(mu_);
  runner_done_ = true;
  cv_.notify_all();
}

StatusOr<std::unique_ptr<Communicator>> create(const GroupOptions& options, Store& store, FormationEvidence* evidence) {
  if (options.device.is_cuda())
    return invalid_argument("gloo backend moves host memory; device " + options.device.to_string() +
                            " needs the nccl backend");
  const std::string where = "gloo group of epoch " + std::to_string(options.epoch) + " (rank " +
                            std::to_string(options.rank) + " of " + std::to_string(options.world_size) + ")";
  try {
    SigpipeBlocked blocked;  // inherited by Gloo's I/O loop thread, started here
    ::gloo::transport::tcp::attr attr;
    if (!options.gloo_interface.empty()) attr.iface = options.gloo_interface;
    else attr.hostname = options.gloo_hostname;
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    auto mesh = connect_mesh(options.rank, options.world_size, device, store, options.bootstrap + "/",
                             Clock::now() + options.init_timeout, options.members);
    if (!mesh.context) {
      if (evidence) {
        evidence->unreachable = mesh.unreachable;
        evidence->no_address = mesh.no_address;
      }
      return unavailable(where + " could not form: " + mesh.error);
    }
    if (evidence) evidence->connected = true;  // what fails from here failed after every pair connected
    auto context = std::make_shared<MeshContext>(options.rank, options.world_size, device, std::move(mesh.context));
    context->setTimeout(kForever);  // the watcher bounds every wait (stall_timeout, op_timeout)
    return std::unique_ptr<Communicator>(new GlooCommunicator(options, std::move(context)));
  } catch (const std::exception& e) {
    return unavailable(where + " could not form: " + e.what());
  }
}

}  // namespace paramcast::gloo_backend
