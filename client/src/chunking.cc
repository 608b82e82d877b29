#include "client/src/chunking.h"

#include <algorithm>

namespace normgrad::client_internal {

RowChunker::RowChunker(uint64_t num_rows, uint64_t row_bytes, uint64_t chunk_bytes)
    : num_rows_(num_rows),
      rows_per_chunk_(std::max<uint64_t>(1, row_bytes == 0 ? 1 : chunk_bytes / row_bytes)),
      num_chunks_((num_rows + rows_per_chunk_ - 1) / rows_per_chunk_) {}

RowRange RowChunker::Chunk(uint64_t index) const {
  const uint64_t first = index * rows_per_chunk_;
  return {first, std::min(rows_per_chunk_, num_rows_ - first)};
}

}  // namespace normgrad::client_internal
