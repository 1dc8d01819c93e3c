// PagePool: which pages of a cache's pool are free. Allocation is all-or-nothing, so a
// request that cannot be served leaves the pool exactly as it was. Not thread-safe: the
// owning Cache serializes access.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace pagedattn {

class PagePool {
 public:
  explicit PagePool(int64_t num_pages) : num_pages_(num_pages) {}

  int64_t num_pages() const { return num_pages_; }
  int64_t num_free() const {
    return num_pages_ - next_unused_ + static_cast<int64_t>(recycled_.size());
  }
  int64_t num_used() const { return num_pages_ - num_free(); }

  // n pages, or RESOURCE_EXHAUSTED (and nothing taken) when fewer than n are free.
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t n);
  // Returns pages to the pool. Each page must be in use.
  void Free(absl::Span<const int32_t> pages);

 private:
  int64_t num_pages_;
  // Pages [next_unused_, num_pages_) were never handed out; recycled_ holds freed ones.
  // This keeps a huge pool's bookkeeping O(pages in use), not O(pool).
  int64_t next_unused_ = 0;
  std::vector<int32_t> recycled_;
};

}  // namespace pagedattn
