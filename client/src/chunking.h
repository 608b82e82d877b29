// Splitting a Backward batch into request messages of whole rows.
//
//   RowChunker chunker(num_rows, row_bytes, /*chunk_bytes=*/1 << 20);
//   for (uint64_t i = 0; i < chunker.num_chunks(); ++i) send(chunker.Chunk(i));
#pragma once

#include <cstdint>

namespace normgrad::client_internal {

struct RowRange {
  uint64_t first_row = 0;
  uint64_t num_rows = 0;
};

// Chunks of max(1, chunk_bytes / row_bytes) rows each; the last one holds the remainder.
// A zero-row batch has zero chunks. Precondition: row_bytes > 0.
class RowChunker {
 public:
  RowChunker(uint64_t num_rows, uint64_t row_bytes, uint64_t chunk_bytes);
  uint64_t rows_per_chunk() const { return rows_per_chunk_; }
  uint64_t num_chunks() const { return num_chunks_; }
  RowRange Chunk(uint64_t index) const;  // precondition: index < num_chunks()

 private:
  uint64_t num_rows_;
  uint64_t rows_per_chunk_;
  uint64_t num_chunks_;
};

}  // namespace normgrad::client_internal
