// pagedattn-bench --profile's JSON and summary (profile_json.h).
#include "kernels/bench/profile_json.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <iterator>
#include <sstream>

#include "kernels/device/profile_layout.h"

namespace pagedattn::kernels {

std::string ProfileJson(const std::string& head, const std::vector<uint64_t>& stamps,
                        std::string* summary) {
  namespace pf = profile;
  uint64_t t0 = UINT64_MAX;
  for (uint64_t t : stamps) {
    if (t != 0) t0 = std::min(t0, t);
  }
  struct RegionInfo {
    const char* name;
    std::array<const char*, pf::kEvents> events;  // null: an event the region does not stamp
  };
  // In profile::Region's order, one a region.
  const RegionInfo regions[] = {
      {"decode_tiles", {"entry", "first tile landed", "last tile done", "exit"}},
      {"decode_wide_tiles", {"entry", "first tile landed", "last tile done", "exit"}},
      {"merge", {"entry", "tiles done (griddepcontrol.wait)", nullptr, "exit"}},
      {"prefill_jobs", {"start", "first tile landed", "last tile done", "rows written"}},
  };
  static_assert(std::size(regions) == pf::kRegions, "a name and events for every region");
  std::ostringstream js;
  js << "{" << head << ", \"units\": \"us from the launch's first stamp\", \"kernels\": {";
  bool first_region = true;
  char text[160];
  for (int r = 0; r < pf::kRegions; ++r) {
    const uint64_t* region = stamps.data() + static_cast<size_t>(r) * pf::kRegionSlots * pf::kEvents;
    int blocks = 0;  // one past the last block that stamped
    for (int b = 0; b < pf::kRegionSlots; ++b) {
      for (int e = 0; e < pf::kEvents; ++e) {
        if (region[b * pf::kEvents + e] != 0) blocks = b + 1;
      }
    }
    if (blocks == 0) continue;
    auto us = [&](int b, int e) {
      const uint64_t t = region[b * pf::kEvents + e];
      return t == 0 ? -1.0 : static_cast<double>(t - t0) * 1e-3;
    };
    std::vector<int> events;  // the region's
    for (int e = 0; e < pf::kEvents; ++e) {
      if (regions[r].events[e] != nullptr) events.push_back(e);
    }
    js << (first_region ? "" : ", ") << "\"" << regions[r].name << "\": {\"events\": [";
    first_region = false;
    for (size_t i = 0; i < events.size(); ++i) {
      js << (i ? ", " : "") << "\"" << regions[r].events[events[i]] << "\"";
    }
    js << "], \"blocks\": [";
    for (int b = 0; b < blocks; ++b) {
      js << (b ? ", [" : "[");
      for (size_t i = 0; i < events.size(); ++i) {
        const double t = us(b, events[i]);
        if (t < 0) {
          std::snprintf(text, sizeof(text), "null");
        } else {
          std::snprintf(text, sizeof(text), "%.3f", t);
        }
        js << (i ? ", " : "") << text;
      }
      js << "]";
    }
    js << "]}";
    std::snprintf(text, sizeof(text), "%s (%d blocks):", regions[r].name, blocks);
    *summary += text;
    for (int e : events) {
      std::vector<double> t;
      for (int b = 0; b < blocks; ++b) {
        if (us(b, e) >= 0) t.push_back(us(b, e));
      }
      if (t.empty()) continue;
      std::sort(t.begin(), t.end());
      std::snprintf(text, sizeof(text), " %s %.2f / %.2f / %.2f;", regions[r].events[e], t.front(),
                    t[t.size() / 2], t.back());
      *summary += text;
    }
    *summary += " (us: first / median / last block)\n";
  }
  js << "}}";
  return js.str();
}

}  // namespace pagedattn::kernels
