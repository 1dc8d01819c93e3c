// PlanAttentionWork: the host side of split-KV. Cuts each span into query-row tiles and, when
// the tiles alone cannot fill the GPU, each tile's KV range into equal chunks.
#include <algorithm>
#include <cstdint>

#include "kernels/paged_attention.h"

namespace pagedattn::kernels {
namespace {

struct Tile {
  int32_t span;
  int32_t row_start;
  int32_t num_rows;
  int32_t kv_end;  // Last visible position + 1 over the tile's rows.
  bool decode;
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void PlanAttentionWork(const AttentionSpan* spans, int num_spans, int num_q_heads,
                       int num_kv_heads, bool causal, int target_blocks, AttentionWork* work,
                       int min_chunk) {
  work->decode_items.clear();
  work->prefill_items.clear();
  work->merge_tasks.clear();
  work->partial_rows = 0;
  const int group = num_q_heads / num_kv_heads;

  std::vector<Tile> tiles;
  int64_t total_positions = 0;  // KV positions summed over tiles: the work to spread.
  for (int i = 0; i < num_spans; ++i) {
    const AttentionSpan& span = spans[i];
    if (span.num_queries <= 0) continue;
    const int rows = span.num_queries * group;
    const bool decode = rows <= kDecodeMaxSpanRows;
    const int tile_rows = decode ? kDecodeTileRows : kPrefillTileRows;
    for (int row_start = 0; row_start < rows; row_start += tile_rows) {
      const int num_rows = std::min(tile_rows, rows - row_start);
      const int last_query = (row_start + num_rows - 1) / group;
      const int kv_end = causal ? span.kv_len - span.num_queries + last_query + 1 : span.kv_len;
      tiles.push_back({i, row_start, num_rows, kv_end, decode});
      total_positions += kv_end;
    }
  }

  // Chunk so that about target_blocks blocks (over all kv heads) share the positions evenly;
  // a multiple of the KV tile so chunks start on tile boundaries; at least min_chunk so that
  // the merge stays small next to the attention itself.
  const int64_t blocks = std::max(1, target_blocks);
  int64_t chunk = CeilDiv(total_positions * num_kv_heads, blocks);
  chunk = CeilDiv(chunk, kKvTileRows) * kKvTileRows;
  chunk = std::max<int64_t>(chunk, std::max(min_chunk, kKvTileRows));
  work->kv_chunk = static_cast<int32_t>(std::min<int64_t>(chunk, INT32_MAX));

  // Items of one span are emitted split-major so that tiles reading the same KV chunk (the
  // tiles of a GQA group wider than 16 rows) run side by side and share it through L2.
  size_t first = 0;
  while (first < tiles.size()) {
    size_t last = first;
    while (last < tiles.size() && tiles[last].span == tiles[first].span) ++last;
    int64_t max_splits = 0;
    std::vector<int32_t> partial_base(last - first, -1), task_index(last - first, -1);
    for (size_t t = first; t < last; ++t) {
      const Tile& tile = tiles[t];
      const int64_t splits = CeilDiv(tile.kv_end, chunk);
      max_splits = std::max(max_splits, splits);
      if (splits > 1) {
        const int tile_rows = tile.decode ? kDecodeTileRows : kPrefillTileRows;
        partial_base[t - first] = static_cast<int32_t>(work->partial_rows);
        task_index[t - first] = static_cast<int32_t>(work->merge_tasks.size());
        work->merge_tasks.push_back({tile.span, tile.row_start, tile.num_rows,
                                     static_cast<int32_t>(splits),
                                     static_cast<int32_t>(work->partial_rows), tile_rows});
        work->partial_rows += splits * tile_rows;
      }
    }
    for (int64_t s = 0; s < max_splits; ++s) {
      for (size_t t = first; t < last; ++t) {
        const Tile& tile = tiles[t];
        const int64_t kv_start = s * chunk;
        if (kv_start >= tile.kv_end) continue;
        AttentionWorkItem item;
        item.span = tile.span;
        item.row_start = tile.row_start;
        item.kv_start = static_cast<int32_t>(kv_start);
        item.kv_end = static_cast<int32_t>(std::min<int64_t>(kv_start + chunk, tile.kv_end));
        const int tile_rows = tile.decode ? kDecodeTileRows : kPrefillTileRows;
        item.partial_row = partial_base[t - first] < 0
                               ? -1
                               : static_cast<int32_t>(partial_base[t - first] + s * tile_rows);
        item.merge_task = task_index[t - first];
        (tile.decode ? work->decode_items : work->prefill_items).push_back(item);
      }
    }
    first = last;
  }
}

}  // namespace pagedattn::kernels
