// SentBaseline: what one sending rank of a many-sender job sent of each
// piece (a region of a tensor) in its last update, and as which version:
// what a delta of that piece is computed against. A trainer rank keeps the
// baseline of the pieces it sends (its shard, at most), never the model.
//
// The version tag is the whole rule: a piece is sent as a delta against
// version B only when this rank sent exactly that piece as B, and the plan
// says every receiver holds B (UpdatePlan::delta_base); anything else goes
// dense, piece by piece. A run records every piece it sends, dense or not,
// and drops the pieces it no longer sends; a failed run drops everything
// (its next run is dense), so no baseline outlives a doubt.
//
// Owner: the thread that runs the rank's transfers (run_reshard), one run
// at a time; bytes() may be read from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/reshard/region.h"

namespace paramcast::reshard {

class SentBaseline {
 public:
  struct Piece {
    std::vector<uint8_t> bytes;  // the piece as sent, packed row-major
    uint64_t version = 0;        // the version those bytes were sent as (0: none yet)
    bool used = false;           // sent by the run under way
  };

  // Starts a run: no piece used yet.
  void begin_run() {
    for (auto& [key, p] : pieces_) p.used = false;
  }
  // The piece this run sends (created empty, version 0, when new).
  Piece& piece(const std::string& tensor, const Region& region) {
    Piece& p = pieces_[{tensor, region}];
    p.used = true;
    return p;
  }
  // Ends a run: a good one keeps the pieces it sent and drops the others; a
  // failed one drops them all.
  void end_run(bool ok) {
    uint64_t total = 0;
    for (auto it = pieces_.begin(); it != pieces_.end();) {
      if (!ok || !it->second.used) {
        it = pieces_.erase(it);
        continue;
      }
      total += it->second.bytes.size();
      ++it;
    }
    bytes_ = total;
  }
  void clear() {
    pieces_.clear();
    bytes_ = 0;
  }
  uint64_t bytes() const { return bytes_; }
  size_t pieces() const { return pieces_.size(); }

 private:
  std::map<std::pair<std::string, Region>, Piece> pieces_;
  std::atomic<uint64_t> bytes_{0};
};

}  // namespace paramcast::reshard
