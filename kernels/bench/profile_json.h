// pagedattn-bench --profile's output: a launch's phase stamps (kernels/device/profile_layout.h)
// as JSON and as a summary a kernel. Host code, tested without a GPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pagedattn::kernels {

// stamps: profile::kSlots * profile::kEvents values as the kernels wrote them (ns, 0: none).
// Returns a JSON object: `head` (the case's own keys, "k": v pairs), "units", and "kernels": for
// each region whose blocks stamped, its "events" and its "blocks" (each block's stamps in grid
// order up to the last that stamped, in microseconds from the launch's first stamp; null where a
// block has none). Appends to *summary a line a region: each event's first, median and last
// block.
std::string ProfileJson(const std::string& head, const std::vector<uint64_t>& stamps,
                        std::string* summary);

}  // namespace pagedattn::kernels
