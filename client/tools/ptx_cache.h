// The `normgrad emit-ptx` local cache: EmitPtx artifacts on disk, shared by concurrent builds.
//
//   absl::StatusOr<PtxCache> cache = PtxCache::Open("/var/cache/normgrad-ptx");
//   const std::string key = PtxCache::Key(server_version, single_configuration_request);
//   absl::StatusOr<v1::EmitPtxArtifact> a = cache->GetOrFetch(key, [&] { return Fetch(); });
//
// Layout, as Bazel's remote cache splits it (an action cache keyed by what was asked, and a
// content-addressed store keyed by what came back):
//   DIR/ac/<sha256 of key>  the artifact without its bytes (digests only), with a sha256 of
//                           itself on its first line
//   DIR/cas/<sha256>        PTX text and cubins, named by their own digest
//   DIR/locks/<sha256 of key>  flock(2) files: one process fetches a key, the others wait
//   DIR/tmp/                files being written; renamed into place when complete
// Every read is verified (the entry's own checksum, each blob's sha256 and size); an entry that
// fails is fetched again and rewritten, never served. Writes are atomic (temp file + rename on
// the same filesystem), so a reader sees a whole old file or a whole new one. flock needs a
// local filesystem (on NFS it may not exclude; entries stay correct, a key may be fetched twice).
//
// The key is the request's configuration (kernel, hidden_dim, dtype, target, ptx_version, cubin,
// resource_usage as asked, the variant: gamma_offset, no_gamma, casting_mode) and the server's
// version. Thread-compatible; separate processes (and
// separate PtxCache objects) may share a directory.
#pragma once

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "normgrad/v1/normgrad.pb.h"

namespace normgrad::tools {

class PtxCache {
 public:
  // Creates DIR and its subfolders when missing. INVALID_ARGUMENT naming the path when it
  // cannot be created or is not a directory.
  static absl::StatusOr<PtxCache> Open(const std::string& dir);

  // The cache key of a single-configuration request for a server of `server_version`.
  static std::string Key(absl::string_view server_version, const v1::EmitPtxRequest& request);

  // The artifact stored under `key`, else `fetch()`'s, stored. A corrupt entry is reported on
  // `notes` (one line: which file, what failed) and fetched again. An artifact whose resource
  // usage was asked but is unknown is returned without being stored (a later server may know).
  using Fetch = std::function<absl::StatusOr<v1::EmitPtxArtifact>()>;
  absl::StatusOr<v1::EmitPtxArtifact> GetOrFetch(const std::string& key, const Fetch& fetch,
                                                 std::string* notes);

  // The artifact stored under `key`: NOT_FOUND when there is none, DATA_LOSS saying what failed
  // when it does not verify.
  absl::StatusOr<v1::EmitPtxArtifact> Read(const std::string& key) const;
  absl::Status Write(const std::string& key, const v1::EmitPtxArtifact& artifact) const;

  // Where things are (tests corrupt them).
  std::string EntryPath(const std::string& key) const;
  std::string BlobPath(absl::string_view sha256) const;

 private:
  explicit PtxCache(std::string dir) : dir_(std::move(dir)) {}
  absl::Status WriteAtomically(const std::string& path, absl::string_view bytes) const;

  std::string dir_;
};

}  // namespace normgrad::tools
