// TMA tensor maps over a K/V pool, for the Hopper prefill kernel's producer: the pool as a
// [rows][head_dim] matrix of 16-bit elements, read in boxes of box_rows rows x 64 columns that
// land in shared memory in the 128-byte swizzle wgmma reads (Sw128Offset's layout).
#pragma once

namespace pagedattn::kernels {

// The fewest rows a box holds: one swizzle atom (8 rows of 128 bytes).
inline constexpr int kTmaMinBoxRows = 8;

// Writes into `map` (a CUtensorMap) the tensor map of `pool` (16-byte aligned, rows of
// head_dim 16-bit elements) in boxes of box_rows rows (a power of two, 8..256). A box's
// elements outside the matrix read as zeros: columns past head_dim (head dims 80 and 96, whose
// tiles are 128 wide), rows before row 0 (a box that stands for positions past a range). The
// row count is the largest a coordinate can name (2^31 - 1): page ids are checked where they
// are written, not here. False where the driver has no cuTensorMapEncodeTiled or refuses the
// map; the caller then copies rows itself.
bool EncodePoolTensorMap(const void* pool, int head_dim, int box_rows, unsigned char (&map)[128]);

}  // namespace pagedattn::kernels
