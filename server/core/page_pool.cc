// PagePool: a LIFO free list over recycled pages plus a never-used watermark.
#include "server/core/page_pool.h"

#include "absl/strings/str_cat.h"

namespace pagedattn {

absl::StatusOr<std::vector<int32_t>> PagePool::Allocate(int64_t n) {
  if (n < 0 || n > num_free()) {
    return absl::ResourceExhaustedError(absl::StrCat("out of KV pages: need ", n, " more, ",
                                                     num_free(), " of ", num_pages_, " free"));
  }
  std::vector<int32_t> pages;
  pages.reserve(static_cast<size_t>(n));
  while (static_cast<int64_t>(pages.size()) < n && !recycled_.empty()) {
    pages.push_back(recycled_.back());
    recycled_.pop_back();
  }
  while (static_cast<int64_t>(pages.size()) < n)
    pages.push_back(static_cast<int32_t>(next_unused_++));
  return pages;
}

void PagePool::Free(absl::Span<const int32_t> pages) {
  recycled_.insert(recycled_.end(), pages.begin(), pages.end());
}

}  // namespace pagedattn
