#include "common/data/split_communicator.h"

#include <functional>
#include <future>

#include "common/data/gloo/gloo_factory.h"
#include "common/data/shm/shm_factory.h"

namespace paramcast {
namespace {

// One plane's view of the group: its ranks (group numbering), in order.
struct Plane {
  std::vector<int> ranks;  // ranks[i] = the group rank of the plane's rank i
  int index_of(int group_rank) const {
    for (size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i] == group_rank) return static_cast<int>(i);
    return -1;
  }
  GroupOptions options(const GroupOptions& group, Backend backend, const std::string& bootstrap) const {
    GroupOptions o = group;
    o.backend = backend;
    o.bootstrap = bootstrap;
    o.world_size = static_cast<int>(ranks.size());
    o.rank = index_of(group.rank);
    o.members.clear();
    for (int r : ranks) o.members.push_back(r < static_cast<int>(group.members.size()) ? group.members[r] : "");
    o.local.clear();
    o.local_bootstrap.clear();
    return o;
  }
};

// The root's broadcast on both planes: the first failure aborts the other
// plane (its broadcast must not go on alone), then both are waited out.
class BothWork : public Work {
 public:
  BothWork(std::shared_ptr<Work> a, std::shared_ptr<Work> b, std::function<void(const std::string&)> abort)
      : a_(std::move(a)), b_(std::move(b)), abort_(std::move(abort)) {}
  Status wait(Deadline deadline) override {
    Status sa = a_->wait(deadline);
    if (!sa.ok()) abort_(sa.message());
    Status sb = b_->wait(deadline);
    if (!sb.ok() && sa.ok()) abort_(sb.message());
    return !sa.ok() ? sa : sb;
  }
  bool settled() override { return a_->settled() && b_->settled(); }

 private:
  std::shared_ptr<Work> a_, b_;
  std::function<void(const std::string&)> abort_;
};

class SplitCommunicator : public Communicator {
 public:
  SplitCommunicator(const GroupOptions& options, Plane local, Plane remote, std::unique_ptr<Communicator> shm,
                    std::unique_ptr<Communicator> backend)
      : options_(options),
        local_(std::move(local)),
        remote_(std::move(remote)),
        shm_(std::move(shm)),
        backend_(std::move(backend)) {}

  std::shared_ptr<Work> broadcast(void* data, size_t bytes, int root) override {
    if (shm_ && backend_)
      return std::make_shared<BothWork>(shm_->broadcast(data, bytes, root), backend_->broadcast(data, bytes, root),
                                        [this](const std::string& why) { abort(why); });
    return (shm_ ? shm_ : backend_)->broadcast(data, bytes, root);
  }
  Status order_after(void* stream) override { return backend_ ? backend_->order_after(stream) : Status(); }
  void abort(const std::string& reason) override {
    if (shm_) shm_->abort(reason);
    if (backend_) backend_->abort(reason);
  }
  Status async_error() override {
    Status s = shm_ ? shm_->async_error() : Status();
    if (s.ok() && backend_) s = backend_->async_error();
    if (!s.ok() && options_.rank == 0) {  // one plane failed: the other must not go on alone
      if (shm_) shm_->abort(s.message());
      if (backend_) backend_->abort(s.message());
    }
    return s;
  }
  std::vector<LinkStats> link_stats() override {
    if (!backend_) return {};
    auto stats = backend_->link_stats();
    for (auto& l : stats)
      if (l.peer >= 0 && l.peer < static_cast<int>(remote_.ranks.size())) l.peer = remote_.ranks[l.peer];
    return stats;
  }
  int stalled_peer() const override {
    const int r = shm_ ? shm_->stalled_peer() : -1;
    return r > 0 && r < static_cast<int>(local_.ranks.size()) ? local_.ranks[static_cast<size_t>(r)] : -1;
  }
  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  Device device() const override { return options_.device; }

 private:
  const GroupOptions options_;
  const Plane local_;
  const Plane remote_;
  std::unique_ptr<Communicator> shm_;
  std::unique_ptr<Communicator> backend_;
};

}  // namespace

StatusOr<std::unique_ptr<Communicator>> create_split_communicator(const GroupOptions& options, Store& store,
                                                                  FormationEvidence* evidence) {
  if (options.local.size() != static_cast<size_t>(options.world_size) || options.rank < 0 ||
      options.rank >= options.world_size)
    return invalid_argument("a mixed group needs one local flag per rank");
  if (options.backend != Backend::kGloo) return invalid_argument("a mixed group runs beside backend gloo only");
  Plane local, remote;
  for (int r = 0; r < options.world_size; ++r) {
    if (r == 0 || options.local[r]) local.ranks.push_back(r);
    if (r == 0 || !options.local[r]) remote.ranks.push_back(r);
  }
  const bool root = options.rank == 0;
  const bool in_shm = local.ranks.size() > 1 && local.index_of(options.rank) >= 0;
  const bool in_backend = remote.ranks.size() > 1 && remote.index_of(options.rank) >= 0;
  const GroupOptions shm_options = local.options(options, Backend::kShm, options.local_bootstrap);
  const GroupOptions backend_options = remote.options(options, Backend::kGloo, options.bootstrap);
  // Both planes form at once (each bounded by init_timeout).
  std::future<StatusOr<std::unique_ptr<Communicator>>> shm;
  FormationEvidence shm_evidence;  // in the shm plane's ranks (the root's: who did not attach)
  if (in_shm)
    shm = std::async(std::launch::async, [&] { return shm_backend::create(shm_options, store, &shm_evidence); });
  StatusOr<std::unique_ptr<Communicator>> backend = std::unique_ptr<Communicator>();
  FormationEvidence plane_evidence;  // in the Gloo plane's ranks
  if (in_backend) backend = gloo_backend::create(backend_options, store, &plane_evidence);
  if (evidence) {
    for (int r : plane_evidence.unreachable) evidence->unreachable.push_back(remote.ranks.at(static_cast<size_t>(r)));
    for (int r : plane_evidence.no_address) evidence->no_address.push_back(remote.ranks.at(static_cast<size_t>(r)));
  }
  StatusOr<std::unique_ptr<Communicator>> shared = std::unique_ptr<Communicator>();
  if (in_shm) shared = shm.get();
  if (evidence)
    for (int r : shm_evidence.unreachable) evidence->unreachable.push_back(local.ranks.at(static_cast<size_t>(r)));
  if (!shared.ok()) return shared.status().with_context("shm plane");
  if (!backend.ok()) return backend.status().with_context("gloo plane");
  if (!root && !in_shm && !in_backend) return internal_error("rank is in neither plane");
  return std::unique_ptr<Communicator>(
      new SplitCommunicator(options, local, remote, std::move(*shared), std::move(*backend)));
}

}  // namespace paramcast
