#include "common/data/shm/segment.h"

#include "common/log.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <set>
#include <thread>

namespace paramcast::shm_backend {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kSecretBytes = 32;
constexpr size_t kNameHex = 32;

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

sockaddr_un address_of(const std::string& name, socklen_t& len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string path = "paramcast-shm-" + name;  // abstract: a leading NUL, no file
  std::memcpy(a.sun_path + 1, path.data(), path.size());
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + path.size());
  return a;
}

bool constant_time_equal(const uint8_t* a, const uint8_t* b, size_t n) {
  uint8_t diff = 0;
  for (size_t i = 0; i < n; ++i) diff |= static_cast<uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

// One reader's request: the secret, then its rank (little-endian int32).
struct Request {
  uint8_t secret[kSecretBytes];
  int32_t rank;
};

// One byte with room for one passed descriptor (SCM_RIGHTS): the message the
// root sends to hand a reader the segment, and the one the reader receives.
// Its header points into itself, so it is never copied.
struct FdMessage {
  char payload = 0;
  iovec iov{&payload, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  FdMessage() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
};

}  // namespace

StatusOr<std::string> Bootstrap::mint() {
  uint8_t raw[16 + kSecretBytes];
  size_t got = 0;
  while (got < sizeof raw) {
    const ssize_t n = getrandom(raw + got, sizeof raw - got, 0);
    if (n < 0 && errno != EINTR) return internal_error(errno_text("getrandom"));
    if (n > 0) got += static_cast<size_t>(n);
  }
  static const char* hex = "0123456789abcdef";
  std::string out = "shm1:";
  for (int i = 0; i < 16; ++i) {
    out += hex[raw[i] >> 4];
    out += hex[raw[i] & 15];
  }
  out += ':';
  out.append(reinterpret_cast<const char*>(raw + 16), kSecretBytes);
  return out;
}

StatusOr<Bootstrap> Bootstrap::parse(const std::string& bytes) {
  if (bytes.size() != 5 + kNameHex + 1 + kSecretBytes || bytes.compare(0, 5, "shm1:") != 0 || bytes[5 + kNameHex] != ':')
    return protocol_error("shm bootstrap of " + std::to_string(bytes.size()) + " bytes is not shm1:<name>:<secret>");
  Bootstrap b;
  b.name = bytes.substr(5, kNameHex);
  for (char c : b.name)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return protocol_error("shm bootstrap name is not hex");
  b.secret = bytes.substr(5 + kNameHex + 1);
  return b;
}

Segment::~Segment() {
  if (base_) munmap(base_, bytes_);
}

StatusOr<std::unique_ptr<Segment>> Segment::host(const Bootstrap& b, int world, uint64_t slot_bytes,
                                                 bool host_slots, std::chrono::milliseconds timeout,
                                                 const std::vector<std::string>& members,
                                                 const std::function<Status(ShmHeader&)>& prepare,
                                                 const std::vector<std::string>& rank_secrets,
                                                 std::vector<int>* missing_ranks) {
  if (world < 1 || world > kMaxRanks) return invalid_argument("shm group of " + std::to_string(world) + " ranks");
  if (!rank_secrets.empty() && rank_secrets.size() != static_cast<size_t>(world))
    return invalid_argument("shm group of " + std::to_string(world) + " ranks with " +
                            std::to_string(rank_secrets.size()) + " rank secrets");
  const size_t bytes = kHeaderBytes + (host_slots ? kSlots * slot_bytes : 0) + p2p_area_bytes(world, host_slots);
  if (slot_bytes < 4096 || slot_bytes > kMaxSlotBytes || slot_bytes % 4096)
    return invalid_argument("shm slots of " + std::to_string(slot_bytes) + " bytes");
  Fd mem(memfd_create("paramcast-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (mem.get() < 0) return internal_error(errno_text("memfd_create"));
  if (ftruncate(mem.get(), static_cast<off_t>(bytes)) != 0) return unavailable(errno_text("ftruncate of the shm segment"));
  // Its size is fixed for good: a reader cannot shrink it under the root (SIGBUS).
  if (fcntl(mem.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    return internal_error(errno_text("sealing the shm segment"));
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mem.get(), 0);
  if (p == MAP_FAILED) return unavailable(errno_text("mmap of the shm segment"));
  std::unique_ptr<Segment> seg(new Segment(static_cast<uint8_t*>(p), bytes, slot_bytes));
  if (p2p_area_bytes(world, host_slots)) seg->p2p_ = static_cast<uint8_t*>(p) + kHeaderBytes + kSlots * slot_bytes;
  seg->cuda_ = !host_slots;
  seg->peer_pids_.assign(static_cast<size_t>(world), 0);
  auto* h = new (p) ShmHeader{};
  h->magic = kMagic;
  h->layout_version = kLayoutVersion;
  h->world = static_cast<uint32_t>(world);
  h->slots = kSlots;
  h->slot_bytes = slot_bytes;
  h->pid[0].store(getpid());
  if (prepare) PC_RETURN_IF_ERROR(prepare(*h));
  if (world == 1) return seg;

  Fd listener(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (listener.get() < 0) return internal_error(errno_text("socket"));
  socklen_t len;
  sockaddr_un addr = address_of(b.name, len);
  if (bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) return internal_error(errno_text("bind"));
  if (listen(listener.get(), world) != 0) return internal_error(errno_text("listen"));
  const auto deadline = Clock::now() + timeout;
  std::set<int> attached;
  while (static_cast<int>(attached.size()) < world - 1) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) break;
    pollfd pfd{listener.get(), POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>(std::min<long long>(left, 100))) <= 0) continue;
    Fd peer(accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (peer.get() < 0) continue;
    // Same user only, and only with the secret the control plane handed out.
    ucred cred{};
    socklen_t clen = sizeof cred;
    if (getsockopt(peer.get(), SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0 || cred.uid != getuid()) continue;
    timeval tv{1, 0};
    setsockopt(peer.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    Request req{};
    if (recv(peer.get(), &req, sizeof req, 0) != static_cast<ssize_t>(sizeof req)) continue;
    if (req.rank < 1 || req.rank >= world) continue;  // a rank already attached may retry: it gets the segment again
    // Its own secret, for the rank it names: a holder of another rank's
    // secret cannot attach as that rank.
    const std::string& want = rank_secrets.empty() ? b.secret : rank_secrets[static_cast<size_t>(req.rank)];
    if (want.size() != kSecretBytes ||
        !constant_time_equal(req.secret, reinterpret_cast<const uint8_t*>(want.data()), kSecretBytes)) {
      PC_WARN("shm segment: a reader (pid " << cred.pid << ") presented another secret than rank " << req.rank
                                            << "'s; refused");
      continue;
    }
    FdMessage m;
    m.payload = 'S';
    cmsghdr* c = CMSG_FIRSTHDR(&m.msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    const int fd = mem.get();
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
    if (sendmsg(peer.get(), &m.msg, MSG_NOSIGNAL) == 1) {
      attached.insert(req.rank);
      seg->peer_pids_[static_cast<size_t>(req.rank)] = cred.pid;  // in this pid namespace (0: not visible)
    }
  }
  if (static_cast<int>(attached.size()) < world - 1) {
    std::string missing;
    for (int r = 1; r < world; ++r)
      if (!attached.count(r)) {
        if (missing_ranks) missing_ranks->push_back(r);
        if (!missing.empty()) missing += ", ";
        missing += r < static_cast<int>(members.size()) && !members[r].empty() ? members[r] : "rank " + std::to_string(r);
      }
    return timeout_error("shm segment: " + missing + " did not attach within init_timeout (" +
                         std::to_string(timeout.count()) + "ms)");
  }
  return seg;
}

StatusOr<std::unique_ptr<Segment>> Segment::attach(const Bootstrap& b, int rank, int world,
                                                   std::chrono::milliseconds timeout) {
  if (rank < 1 || rank >= world || world > kMaxRanks)
    return invalid_argument("shm reader rank " + std::to_string(rank) + " of " + std::to_string(world));
  const auto deadline = Clock::now() + timeout;
  socklen_t len;
  sockaddr_un addr = address_of(b.name, len);
  std::string last = "no attempt";
  while (Clock::now() < deadline) {
    // Non-blocking: a full backlog must not hold this reader past its deadline.
    Fd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (s.get() < 0) return internal_error(errno_text("socket"));
    if (connect(s.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      last = errno_text("connect");  // the root is not listening yet, or its backlog is full
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    // The peer must be the same user as this reader: the secret goes to nobody else.
    ucred server{};
    socklen_t slen = sizeof server;
    if (getsockopt(s.get(), SOL_SOCKET, SO_PEERCRED, &server, &slen) != 0 || server.uid != getuid()) {
      last = "the socket's owner is another user";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    const int flags = fcntl(s.get(), F_GETFL);
    fcntl(s.get(), F_SETFL, flags & ~O_NONBLOCK);
    Request req{};
    std::memcpy(req.secret, b.secret.data(), kSecretBytes);
    req.rank = rank;
    if (send(s.get(), &req, sizeof req, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof req)) {
      last = errno_text("send");
      continue;
    }
    // Up to the deadline: the root serves readers one at a time.
    const auto left = std::max<long long>(
        1, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    timeval tv{static_cast<time_t>(left / 1000), static_cast<suseconds_t>((left % 1000) * 1000)};
    setsockopt(s.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    FdMessage m;
    if (recvmsg(s.get(), &m.msg, MSG_CMSG_CLOEXEC) != 1 || m.payload != 'S') {
      last = "the root closed without handing over the segment (a wrong secret or rank)";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    cmsghdr* c = CMSG_FIRSTHDR(&m.msg);
    if (!c || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(sizeof(int)))
      return protocol_error("shm segment: the root's reply carries no descriptor");
    int raw;
    std::memcpy(&raw, CMSG_DATA(c), sizeof raw);
    Fd mem(raw);
    struct stat st {};
    if (fstat(mem.get(), &st) != 0 || st.st_size < static_cast<off_t>(kHeaderBytes))
      return protocol_error("shm segment of " + std::to_string(st.st_size) + " bytes");
    void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, mem.get(), 0);
    if (p == MAP_FAILED) return unavailable(errno_text("mmap of the shm segment"));
    const ShmHeader& h = *static_cast<const ShmHeader*>(p);
    const uint64_t slot_bytes = h.slot_bytes;
    const uint32_t cuda = h.cuda;  // read once: the layout is judged on what this process read
    const bool ok = h.magic == kMagic && h.layout_version == kLayoutVersion && h.slots == kSlots &&
                    h.world == static_cast<uint32_t>(world) && cuda <= 1 && slot_bytes >= 4096 &&
                    slot_bytes <= kMaxSlotBytes && slot_bytes % 4096 == 0 &&
                    kHeaderBytes + (cuda ? 0 : kSlots * slot_bytes) + p2p_area_bytes(world, !cuda) ==
                        static_cast<uint64_t>(st.st_size);
    std::unique_ptr<Segment> seg(new Segment(static_cast<uint8_t*>(p), static_cast<size_t>(st.st_size), slot_bytes));
    if (!ok)
      return protocol_error("shm segment: unexpected layout (version " + std::to_string(h.layout_version) + ", " +
                            std::to_string(h.world) + " ranks, this group has " + std::to_string(world) +
                            ", slots of " + std::to_string(slot_bytes) + " bytes)");
    if (p2p_area_bytes(world, !cuda)) seg->p2p_ = static_cast<uint8_t*>(p) + kHeaderBytes + kSlots * slot_bytes;
    seg->cuda_ = cuda != 0;
    seg->peer_pids_.assign(1, server.pid);  // the root, in this pid namespace
    seg->header().pid[rank].store(getpid());
    return seg;
  }
  return timeout_error("shm segment: could not attach within init_timeout (" + std::to_string(timeout.count()) +
                       "ms): " + last);
}

}  // namespace paramcast::shm_backend
