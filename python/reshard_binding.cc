// paramcast._core.plan_reshard: the many-sender plan (common/reshard/) for
// Python, over plain data: each rank a dict of its tensors' specs, what it
// holds and what it wants; the plan back as a dict. No logic of its own.
#include "common/reshard/reshard_plan.h"
#include "python/bindings.h"
#include "python/errors.h"

namespace paramcast::python {
namespace {

using reshard::Region;

Region region_of(const py::handle& h) {
  auto t = h.cast<py::tuple>();
  if (t.size() != 2) throw py::value_error("a region is (offsets, lengths)");
  Region r{t[0].cast<std::vector<int64_t>>(), t[1].cast<std::vector<int64_t>>()};
  if (r.offsets.size() != r.lengths.size())
    throw py::value_error("a region has " + std::to_string(r.offsets.size()) + " offsets and " +
                          std::to_string(r.lengths.size()) + " lengths");
  return r;
}

std::vector<reshard::Holding> regions(const py::dict& rank, const char* key) {
  std::vector<reshard::Holding> out;
  if (!rank.contains(key)) return out;
  for (auto item : rank[key].cast<py::list>()) {
    auto t = item.cast<py::tuple>();
    if (t.size() != 2) throw py::value_error(std::string("'") + key + "' items are (name, (offsets, lengths))");
    out.push_back({t[0].cast<std::string>(), region_of(t[1])});
  }
  return out;
}

py::dict plan(const py::list& ranks, bool forward) {
  std::vector<reshard::RankManifest> in;
  for (auto r : ranks) {
    auto d = r.cast<py::dict>();
    reshard::RankManifest m;
    m.rank = d["rank"].cast<int>();
    m.name = d.contains("name") ? d["name"].cast<std::string>() : "rank " + std::to_string(m.rank);
    for (auto t : d["tensors"].cast<py::list>()) {
      auto spec = t.cast<py::tuple>();
      auto dtype = parse_dtype(spec[1].cast<std::string>());
      if (!dtype) throw py::value_error("unknown dtype '" + spec[1].cast<std::string>() + "'");
      m.tensors.push_back({spec[0].cast<std::string>(), *dtype, spec[2].cast<std::vector<int64_t>>()});
    }
    m.holds = regions(d, "holds");
    m.wants = regions(d, "wants");
    in.push_back(std::move(m));
  }
  auto p = reshard::plan_reshard(in, reshard::ReshardOptions{forward});
  if (!p.ok()) throw_status(p.status(), "ConfigError");
  py::list transfers;
  for (const auto& x : p->transfers)
    transfers.append(py::dict(py::arg("source") = x.from, py::arg("to") = x.to,
                              py::arg("tensor") = p->tensors[x.tensor].name,
                              py::arg("region") = py::make_tuple(x.region.offsets, x.region.lengths),
                              py::arg("bytes") = x.bytes, py::arg("after") = x.after));
  return py::dict(py::arg("transfers") = transfers, py::arg("sent") = p->sent, py::arg("received") = p->received,
                  py::arg("least_busiest_bytes") = p->least_busiest_bytes,
                  py::arg("busiest_bytes") = p->busiest_bytes());
}

}  // namespace

void bind_reshard(py::module_& m) {
  m.def("plan_reshard", &plan, py::arg("ranks"), py::arg("forward") = true,
        "The many-sender plan: each rank a dict with 'rank', 'name', 'tensors' [(name, dtype, shape)], "
        "'holds' and 'wants' [(name, (offsets, lengths))]. Returns the transfers and each rank's bytes, or "
        "raises ConfigError naming every mismatch (tensor, range, ranks).");
}

}  // namespace paramcast::python
