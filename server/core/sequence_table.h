// SequenceTable: each sequence's page list (shared by all layers) and its length per layer,
// plus batch reservations that either apply completely or are rolled back completely.
// Not thread-safe: the owning Cache serializes access.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/core/page_pool.h"

namespace pagedattn {

struct Sequence {
  // Page i holds positions [i*page_size, (i+1)*page_size); exactly the pages of the longest
  // layer, counting a layer a reservation rewinds at its length before it (never fewer:
  // Reserve relies on it, and a rollback must find the old length's pages).
  std::vector<int32_t> pages;
  std::vector<int64_t> layer_len;  // Tokens written per layer.
  // Layers a reservation in flight rewinds, with their lengths before it: until it commits, the
  // pages those lengths need stay, whatever other layers do (a layer's reservations run one at
  // a time, so a layer appears at most once).
  std::vector<std::pair<int32_t, int64_t>> rewinding;
};

// One span's write request against the table.
struct SpanWrite {
  uint64_t seq_id = 0;
  int64_t start = 0;
  int32_t num_new_tokens = 0;
};

// What a reservation changed, so it can be committed or undone.
struct Reservation {
  int32_t layer = 0;
  struct Entry {
    uint64_t seq_id;
    int64_t old_len;  // Length of the layer before the reservation.
    int64_t kv_len;   // Length attended after it.
  };
  std::vector<Entry> entries;  // In span order.
};

class SequenceTable {
 public:
  SequenceTable(int32_t num_layers, int32_t page_size, int64_t num_pages)
      : num_layers_(num_layers), page_size_(page_size), pool_(num_pages) {}

  // Validates every span (sequence exists or is created by a write at 0, no position gap),
  // then checks that each fits the pool and that enough pages are free for all of them, then
  // grows each sequence and sets the layer's length to start+num_new_tokens. Fails with
  // nothing changed, in this order: NOT_FOUND (attend-only span on an unknown sequence),
  // FAILED_PRECONDITION (gap), RESOURCE_EXHAUSTED (longer than the pool, or out of pages).
  absl::StatusOr<Reservation> Reserve(int32_t layer, absl::Span<const SpanWrite> spans);
  // Keeps the new lengths; frees pages a rewind left unused.
  void Commit(const Reservation& r);
  // Restores the old lengths and frees pages the reservation took.
  void Rollback(const Reservation& r);

  // Frees the sequence's pages. Returns the pages freed, or -1 when unknown.
  int64_t Release(uint64_t seq_id);
  // Shortens the layer to at most `length` tokens (freeing pages no layer needs any more, and
  // the sequence when no layer has a token). Returns the pages freed, or -1 when unknown.
  int64_t Truncate(int32_t layer, uint64_t seq_id, int64_t length);

  const Sequence* Find(uint64_t seq_id) const;
  int64_t num_sequences() const { return static_cast<int64_t>(seqs_.size()); }
  const PagePool& pool() const { return pool_; }
  int32_t page_size() const { return page_size_; }
  int64_t PagesFor(int64_t tokens) const { return (tokens + page_size_ - 1) / page_size_; }

 private:
  // Pages the spans' rewinds of `layer` would leave unused once committed.
  int64_t RewindPages(int32_t layer, absl::Span<const SpanWrite> spans) const;
  // The longest layer, a layer in a rewind in flight at its length before it.
  static int64_t Longest(const Sequence& seq);
  // Ends the reservation's rewind of `layer` (Commit, Rollback).
  static void EndRewind(Sequence& seq, int32_t layer);
  // Drops pages beyond the longest layer; drops the sequence when every layer is empty.
  void Shrink(uint64_t seq_id);

  int32_t num_layers_;
  int32_t page_size_;
  PagePool pool_;
  absl::flat_hash_map<uint64_t, Sequence> seqs_;
};

}  // namespace pagedattn
