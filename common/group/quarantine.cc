// GroupHost's quarantine (group_host.h): strikes counted from failed
// formations, who is left out of formations and for how long, and the link
// checks (link_check.h) a quarantined member on the Gloo plane passes before
// it is tried again.
#include "common/control/messages.h"
#include "common/group/group_host.h"
#include "common/log.h"
#include "common/units.h"

#include <algorithm>
#include <thread>

namespace paramcast::group {

// A member named by a failed formation gets a strike (conclusive evidence:
// quarantined at once); one that was ready and not named is cleared. Members
// caught in a formation that another member ended keep what they had.
void GroupHost::count_strikes(const std::vector<std::string>& members, const std::map<std::string, std::string>& named,
                              const std::set<std::string>& conclusive, const std::set<std::string>& data_path) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  for (const auto& id : members)
    if (ready_.count(id) && !named.count(id)) strikes_.erase(id);
  last_blamed_.clear();
  last_conclusive_.clear();
  for (const auto& [id, why] : named) last_blamed_.push_back(id);
  if (members.size() > 1 && named.size() == members.size()) {
    PC_WARN("publisher: every member of the failed formation was named; no strikes (this evidence cannot tell "
            "which one is at fault)");
    return;
  }
  for (const auto& [id, why] : named) {
    if (why == kLostDuringFormation || why == kRejoinedDuringFormation) continue;
    const bool now_out = conclusive.count(id) > 0;
    strike_locked(id, why, now_out ? 2 : 0, now, data_path.count(id) > 0);
    if (now_out) last_conclusive_.push_back(id);
  }
}

void GroupHost::strike_locked(const std::string& id, const std::string& reason, int at_least, Clock::time_point now,
                              bool data_path) {
  const auto backoff = cfg_.publisher.quarantine_backoff;
  Strikes& s = strikes_[id];
  if (s.count > 0 && now - s.last > 32 * backoff) s = Strikes{};  // an old failure is forgiven
  s.count = std::max(s.count + 1, at_least);
  s.reason = reason;
  s.last = now;
  s.data_path = data_path;
  if (s.count < 2) return;
  const int doublings = std::min(s.count - 2, 4);
  const auto length = backoff * (1 << doublings);
  s.until = now + length;
  const std::string after = at_least >= 2 ? std::string("at once")
                                          : "after " + std::to_string(s.count) + " failed group formations in a row";
  PC_WARN("publisher: subscriber '" << id << "' quarantined for " << format_duration(length) << " " << after
                                    << " (" << reason << "); it is tried again after that");
}

std::map<std::string, std::string> GroupHost::excluded(Clock::time_point now) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, std::string> out;
  for (const auto& [id, l] : left_out_)
    if (l.until > now)
      out[id] = l.reason + "; " + format_duration(std::chrono::duration_cast<Millis>(l.until - now)) + " more";
  for (const auto& [id, s] : strikes_) {
    if (s.count < 2) continue;
    if (now - s.last > 32 * cfg_.publisher.quarantine_backoff) continue;  // forgiven (strike_locked resets it)
    const bool checked = checked_locked(id);
    const auto check = checked ? checks_->last(id) : std::nullopt;
    const bool passed = check && check->passed && check->at > s.last;
    if (s.until > now) {
      if (checked && passed && s.data_path && !s.burned) continue;  // its data path works again: tried at once
      const auto left = std::chrono::duration_cast<Millis>(s.until - now);
      out[id] = s.reason + "; quarantined " + format_duration(left) + " more";
    } else if (checked && !passed) {
      std::string why = s.reason + "; quarantine served, tried again once its data path passes a link check";
      if (check && check->at > s.last) why += " (the last one failed: " + check->why + ")";
      out[id] = why;
    }
  }
  return out;
}

GroupHost::~GroupHost() {
  std::shared_ptr<LinkCheckHost> checks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    checks = std::move(checks_);
  }
  if (checks) checks->stop();  // its thread calls due_checks(): stopped without mu_ held
}

bool GroupHost::checked_locked(const std::string& id) const {
  if (!checks_ || checks_->failed() || cfg_.data_plane.backend != Backend::kGloo) return false;
  const auto m = server_.member(id);
  if (!m || m->lost || !m->link_check) return false;  // not live, or it cannot answer checks
  return host_identity_.empty() || m->host_identity != host_identity_;  // this host's members read shm
}

std::vector<std::string> GroupHost::due_checks() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  const auto now = Clock::now();
  for (const auto& [id, s] : strikes_) {
    if (s.count < 2 || !checked_locked(id)) continue;
    if (now - s.last > 32 * cfg_.publisher.quarantine_backoff) continue;  // forgiven: tried anyway
    const auto check = checks_->last(id);
    if (check && check->passed && check->at > s.last) continue;  // passed since its last failure
    // Out early if its data path works; else a check shortly before its backoff ends.
    if ((s.data_path && !s.burned) || s.until <= now + 2 * kLinkCheckInterval) out.push_back(id);
  }
  return out;
}

std::vector<std::string> GroupHost::last_blamed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_blamed_;
}

std::vector<std::string> GroupHost::last_conclusive() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_conclusive_;
}

void GroupHost::quarantine(const std::string& id, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    strike_locked(id, reason, 2, Clock::now());
  }
  ensure_checks();
}

std::vector<std::string> GroupHost::probe_data_paths(const std::map<std::string, std::string>& suspects) {
  if (suspects.empty()) return {};
  ensure_checks(true);
  const auto since = Clock::now();
  std::vector<std::string> probed;
  std::shared_ptr<LinkCheckHost> checks;
  {
    std::lock_guard<std::mutex> lock(mu_);  // stop() takes checks_ under it: not stopped while asked
    if (stopped_) return {};
    for (const auto& [id, why] : suspects)
      if (checked_locked(id)) probed.push_back(id);
    checks = checks_;
    for (const auto& id : probed) checks->check_now(id);
  }
  if (probed.empty()) return {};
  auto finished = [&](const std::string& id) {
    const auto r = checks->last(id);
    return r && r->at >= since;
  };
  const auto deadline = since + kLinkCheckTimeout + Millis(1000);
  while (Clock::now() < deadline && !std::all_of(probed.begin(), probed.end(), finished)) {
    if (std::lock_guard<std::mutex> lock(mu_); stopped_) return {};
    std::this_thread::sleep_for(Millis(10));
  }
  // Only a check that ran since and failed counts: one not finished in
  // time (not started, a busy host) leaves its member to the formation, as
  // before. Where every member probed failed, the fault may be this host's
  // own link: nobody is struck (as count_strikes does for a formation).
  std::map<std::string, std::string> failed;
  for (const auto& id : probed)
    if (const auto r = checks->last(id); r && r->at >= since && !r->passed) failed[id] = r->why;
  std::vector<std::string> out;
  if (failed.empty()) return out;
  if (probed.size() > 1 && failed.size() == probed.size()) {
    PC_WARN("publisher: the link check of every member the failed update named failed (" << failed.begin()->second
                                                                                          << "); no strikes (the "
                                                                                             "publisher's own link "
                                                                                             "may be down)");
    return out;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, why] : failed) {
    PC_WARN("publisher: link check of '" << id << "' failed before the next formation (" << why << ")");
    strike_locked(id, suspects.at(id) + "; its link check failed: " + why, 2, Clock::now(), true);
    out.push_back(id);
  }
  return out;
}

// Started with the first quarantine, outside mu_ (it resolves the data
// address and starts a thread that takes mu_).
void GroupHost::ensure_checks(bool now) {
  if (cfg_.data_plane.backend != Backend::kGloo) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (checks_tried_ || stopped_ ||
        (!now && std::none_of(strikes_.begin(), strikes_.end(), [](const auto& s) { return s.second.count >= 2; })))
      return;
    checks_tried_ = true;
  }
  auto host = std::make_unique<LinkCheckHost>(
      cfg_.data_plane.gloo_hostname, cfg_.data_plane.gloo_interface,
      LinkCheckHost::Hooks{[this] { return due_checks(); },
                           [this](const std::string& to, const LinkCheckRequest& r) {
                             server_.send(to, control::make_message(epoch_, server_.incarnation(), [&](auto b) {
                               auto c = b.initLinkCheck();
                               c.setToken(kj::arrayPtr(reinterpret_cast<const kj::byte*>(r.token.data()),
                                                       r.token.size()));
                               c.setEndpoint(r.endpoint);
                               c.setBytes(r.bytes);
                               c.setTimeoutMs(static_cast<uint32_t>(r.timeout.count()));
                             }));
                           }});
  if (Status started = host->start(); !started.ok()) {
    PC_WARN("publisher: no link checks (" << started.message()
                                          << "): a quarantined member is tried again when its backoff ends");
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopped_) {
      checks_ = std::move(host);
      return;
    }
  }
  host->stop();  // stop() came meanwhile
}

}  // namespace paramcast::group
