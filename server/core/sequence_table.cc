// SequenceTable: validation and two-phase (reserve, then commit or roll back) growth.
#include "server/core/sequence_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/core/error_info.h"

namespace pagedattn {

absl::StatusOr<Reservation> SequenceTable::Reserve(int32_t layer,
                                                   absl::Span<const SpanWrite> spans) {
  // Phase 1: check everything and count the pages, touching nothing. What the request means
  // (unknown sequences, gaps) is checked before whether it fits, so a request that is wrong in
  // both ways gets the error that a retry with more pages would not fix.
  for (const SpanWrite& s : spans) {
    auto it = seqs_.find(s.seq_id);
    const int64_t len = it == seqs_.end() ? 0 : it->second.layer_len[layer];
    if (it == seqs_.end() && s.num_new_tokens == 0) {
      return absl::NotFoundError(
          absl::StrCat("sequence ", s.seq_id,
                       " not found (a span with num_new_tokens=0 attends an existing "
                       "sequence; create it by writing tokens at start=0)"));
    }
    if (s.start > len) {
      return absl::FailedPreconditionError(absl::StrCat(
          "span for sequence ", s.seq_id, ": start=", s.start, " leaves a gap: the sequence has ",
          len, " tokens in layer ", layer, " (start must be <= ", len, ")"));
    }
  }
  const int64_t capacity_tokens = pool_.num_pages() * page_size_;
  int64_t pages_needed = 0;
  for (const SpanWrite& s : spans) {
    if (s.start + s.num_new_tokens > capacity_tokens) {
      return WithErrorInfo(absl::ResourceExhaustedError(absl::StrCat(
                               "sequence ", s.seq_id, ": length ", s.start + s.num_new_tokens,
                               " exceeds the cache's capacity of ", capacity_tokens, " tokens (",
                               pool_.num_pages(), " pages x ", page_size_, ")")),
                           {"SEQUENCE_TOO_LONG",
                            {{"sequence_length", s.start + s.num_new_tokens},
                             {"capacity_tokens", capacity_tokens}}});
    }
    if (s.num_new_tokens > 0) {
      // A sequence's pages cover its longest layer (Shrink keeps them so), so only this
      // layer's new length can need more: no pass over the other layers' lengths.
      auto it = seqs_.find(s.seq_id);
      const int64_t have = it == seqs_.end() ? 0 : static_cast<int64_t>(it->second.pages.size());
      pages_needed += std::max<int64_t>(0, PagesFor(s.start + s.num_new_tokens) - have);
    }
  }
  if (pages_needed > pool_.num_free()) {
    // Pages that this Forward's rewinds leave unused go back to the pool only when it commits:
    // until then its kernel may not write them (a rollback restores the old lengths, whose K/V
    // they hold). Named here, since a TruncateSequences first would free them.
    const int64_t rewind_pages = RewindPages(layer, spans);
    return WithErrorInfo(
        absl::ResourceExhaustedError(absl::StrCat(
            "out of KV pages: this Forward needs ", pages_needed,
            pages_needed == 1 ? " more page of " : " more pages of ", page_size_,
            page_size_ == 1 ? " token, " : " tokens, ", pool_.num_free(), " of ", pool_.num_pages(),
            " are free (release finished sequences or create a larger cache)",
            rewind_pages == 0 ? ""
                              : absl::StrCat("; its rewinds leave ", rewind_pages,
                                             rewind_pages == 1 ? " page" : " pages",
                                             " unused, freed only once a Forward completes: "
                                             "TruncateSequences first frees them"))),
        {"OUT_OF_PAGES",
         {{"pages_needed", pages_needed},
          {"free_pages", pool_.num_free()},
          {"total_pages", pool_.num_pages()},
          {"page_size", page_size_}}});
  }

  // Phase 2: apply. Cannot fail: the pages are known to be free.
  Reservation r;
  r.layer = layer;
  r.entries.reserve(spans.size());
  for (const SpanWrite& s : spans) {
    auto [it, created] = seqs_.try_emplace(s.seq_id);
    Sequence& seq = it->second;
    if (created) seq.layer_len.assign(num_layers_, 0);
    const int64_t old_len = seq.layer_len[layer];
    if (s.num_new_tokens == 0) {
      r.entries.push_back({s.seq_id, old_len, s.start});
      continue;
    }
    const int64_t new_len = s.start + s.num_new_tokens;
    const int64_t want = PagesFor(new_len);
    if (want > static_cast<int64_t>(seq.pages.size())) {
      std::vector<int32_t> more = *pool_.Allocate(want - static_cast<int64_t>(seq.pages.size()));
      seq.pages.insert(seq.pages.end(), more.begin(), more.end());
    }
    // A rewind: the old length's pages stay until this reservation ends (another layer's
    // commit, rollback or truncation must not free them: a rollback restores that length).
    if (new_len < old_len) seq.rewinding.emplace_back(layer, old_len);
    seq.layer_len[layer] = new_len;
    r.entries.push_back({s.seq_id, old_len, new_len});
  }
  return r;
}

int64_t SequenceTable::RewindPages(int32_t layer, absl::Span<const SpanWrite> spans) const {
  int64_t pages = 0;
  for (const SpanWrite& s : spans) {
    auto it = seqs_.find(s.seq_id);
    if (it == seqs_.end() || s.num_new_tokens == 0) continue;  // attending rewinds nothing
    const Sequence& seq = it->second;
    int64_t longest = s.start + s.num_new_tokens;
    if (longest >= seq.layer_len[layer]) continue;
    for (int32_t l = 0; l < num_layers_; ++l) {
      if (l != layer) longest = std::max(longest, seq.layer_len[l]);
    }
    for (const auto& [l, len] : seq.rewinding) {
      if (l != layer) longest = std::max(longest, len);
    }
    pages += std::max<int64_t>(0, static_cast<int64_t>(seq.pages.size()) - PagesFor(longest));
  }
  return pages;
}

void SequenceTable::Commit(const Reservation& r) {
  // Growing a layer leaves the pages covering exactly the longest layer; only a rewind (a layer
  // now shorter than before) can leave pages no layer needs.
  for (const Reservation::Entry& e : r.entries) {
    if (e.kv_len >= e.old_len) continue;
    auto it = seqs_.find(e.seq_id);
    if (it == seqs_.end()) continue;
    EndRewind(it->second, r.layer);
    Shrink(e.seq_id);
  }
}

void SequenceTable::Rollback(const Reservation& r) {
  for (const Reservation::Entry& e : r.entries) {
    auto it = seqs_.find(e.seq_id);
    if (it == seqs_.end()) continue;
    it->second.layer_len[r.layer] = e.old_len;
    EndRewind(it->second, r.layer);
    Shrink(e.seq_id);
  }
}

int64_t SequenceTable::Longest(const Sequence& seq) {
  int64_t longest = *std::max_element(seq.layer_len.begin(), seq.layer_len.end());
  for (const auto& [layer, len] : seq.rewinding) longest = std::max(longest, len);
  return longest;
}

void SequenceTable::EndRewind(Sequence& seq, int32_t layer) {
  std::erase_if(seq.rewinding, [layer](const auto& e) { return e.first == layer; });
}

void SequenceTable::Shrink(uint64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  Sequence& seq = it->second;
  const int64_t longest = Longest(seq);
  const int64_t keep = PagesFor(longest);
  if (keep < static_cast<int64_t>(seq.pages.size())) {
    pool_.Free(absl::MakeConstSpan(seq.pages).subspan(static_cast<size_t>(keep)));
    seq.pages.resize(static_cast<size_t>(keep));
  }
  if (longest == 0) seqs_.erase(it);
}

int64_t SequenceTable::Release(uint64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return -1;
  const int64_t n = static_cast<int64_t>(it->second.pages.size());
  pool_.Free(it->second.pages);
  seqs_.erase(it);
  return n;
}

int64_t SequenceTable::Truncate(int32_t layer, uint64_t seq_id, int64_t length) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return -1;
  const int64_t before = static_cast<int64_t>(it->second.pages.size());
  int64_t& len = it->second.layer_len[layer];
  len = std::min(len, length);
  Shrink(seq_id);
  it = seqs_.find(seq_id);
  return before - (it == seqs_.end() ? 0 : static_cast<int64_t>(it->second.pages.size()));
}

const Sequence* SequenceTable::Find(uint64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? nullptr : &it->second;
}

}  // namespace pagedattn
