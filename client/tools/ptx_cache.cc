#include "client/tools/ptx_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "base/sha256.h"

namespace normgrad::tools {

namespace {

constexpr absl::string_view kEntryMagic = "normgrad-ptx-cache 1";

std::string ErrnoText() { return std::strerror(errno); }

absl::Status MakeDirectory(const std::string& path) {
  if (mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cache-dir: cannot create ", path, ": ", ErrnoText()));
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("--cache-dir: ", path, " is not a directory"));
  }
  return absl::OkStatus();
}

// NOT_FOUND when the file does not exist.
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": ", ErrnoText()));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return bytes.str();
}

// An exclusive flock(2) on a file, released (and closed) by the destructor.
class FileLock {
 public:
  explicit FileLock(const std::string& path) : fd_(open(path.c_str(), O_RDWR | O_CREAT, 0644)) {
    if (fd_ >= 0) {
      while (flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
    }
  }
  ~FileLock() {
    if (fd_ >= 0) close(fd_);  // closing releases the lock
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
};

}  // namespace

absl::StatusOr<PtxCache> PtxCache::Open(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("--cache-dir: empty path");
  for (const std::string& path : {dir, dir + "/ac", dir + "/cas", dir + "/locks", dir + "/tmp"}) {
    if (absl::Status s = MakeDirectory(path); !s.ok()) return s;
  }
  return PtxCache(dir);
}

std::string PtxCache::Key(absl::string_view server_version, const v1::EmitPtxRequest& request) {
  return absl::StrCat("server_version=", server_version, "\nkernel=", request.kernel(),
                      "\nhidden_dim=", request.hidden_dim(),
                      "\ndtype=", static_cast<int>(request.dtype()), "\ntarget=", request.target(),
                      "\nptx_version=", request.ptx_version(), "\ncubin=", request.cubin(),
                      "\nresource_usage=", request.resource_usage(),
                      // The variant; the offset by its bits (StrCat prints six digits).
                      "\ngamma_offset_bits=", absl::bit_cast<uint32_t>(request.gamma_offset()),
                      "\nno_gamma=", request.no_gamma(),
                      "\ncasting_mode=", static_cast<int>(request.casting_mode()), "\n");
}

std::string PtxCache::EntryPath(const std::string& key) const {
  return absl::StrCat(dir_, "/ac/", base::Sha256Hex(key));
}

std::string PtxCache::BlobPath(absl::string_view sha256) const {
  return absl::StrCat(dir_, "/cas/", sha256);
}

absl::Status PtxCache::WriteAtomically(const std::string& path, absl::string_view bytes) const {
  // A name no other writer uses (pid, a counter), in the cache's own tmp/ so that rename stays on
  // one filesystem.
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(dir_, "/tmp/", getpid(), ".", counter++);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      unlink(tmp.c_str());
      return absl::InternalError(absl::StrCat("cache: cannot write ", tmp));
    }
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string error = ErrnoText();
    unlink(tmp.c_str());
    return absl::InternalError(
        absl::StrCat("cache: cannot rename ", tmp, " to ", path, ": ", error));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::EmitPtxArtifact> PtxCache::Read(const std::string& key) const {
  const std::string path = EntryPath(key);
  absl::StatusOr<std::string> file = ReadFile(path);
  if (!file.ok()) return file.status();
  // "MAGIC\nSHA256\n" then the serialized artifact (without its PTX and cubin bytes).
  const size_t first = file->find('\n');
  const size_t second = first == std::string::npos ? first : file->find('\n', first + 1);
  if (second == std::string::npos || absl::string_view(*file).substr(0, first) != kEntryMagic) {
    return absl::DataLossError(absl::StrCat(path, ": not a cache entry (no header)"));
  }
  const std::string want = file->substr(first + 1, second - first - 1);
  const absl::string_view body = absl::string_view(*file).substr(second + 1);
  if (base::Sha256Hex(body) != want) {
    return absl::DataLossError(absl::StrCat(path, ": sha256 of the entry is not ", want));
  }
  v1::EmitPtxArtifact artifact;
  if (!artifact.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    return absl::DataLossError(absl::StrCat(path, ": the entry does not parse"));
  }
  auto load = [&](const v1::Digest& digest, std::string* out) -> absl::Status {
    const std::string blob = BlobPath(digest.sha256());
    absl::StatusOr<std::string> bytes = ReadFile(blob);
    if (!bytes.ok()) return absl::DataLossError(bytes.status().message());
    if (bytes->size() != digest.size_bytes() || base::Sha256Hex(*bytes) != digest.sha256()) {
      return absl::DataLossError(absl::StrCat(blob, ": ", bytes->size(),
                                              " bytes whose sha256 is not the name's (",
                                              digest.size_bytes(), " bytes expected)"));
    }
    *out = *std::move(bytes);
    return absl::OkStatus();
  };
  if (absl::Status s = load(artifact.digest(), artifact.mutable_ptx()); !s.ok()) return s;
  if (artifact.has_cubin_digest()) {
    if (absl::Status s = load(artifact.cubin_digest(), artifact.mutable_cubin()); !s.ok()) {
      return s;
    }
  }
  return artifact;
}

absl::Status PtxCache::Write(const std::string& key, const v1::EmitPtxArtifact& artifact) const {
  // Blobs first: an entry never names a blob that was not written.
  if (absl::Status s = WriteAtomically(BlobPath(artifact.digest().sha256()), artifact.ptx());
      !s.ok()) {
    return s;
  }
  if (artifact.has_cubin_digest()) {
    if (absl::Status s =
            WriteAtomically(BlobPath(artifact.cubin_digest().sha256()), artifact.cubin());
        !s.ok()) {
      return s;
    }
  }
  v1::EmitPtxArtifact entry = artifact;
  entry.clear_ptx();
  entry.clear_cubin();
  const std::string body = entry.SerializeAsString();
  return WriteAtomically(EntryPath(key),
                         absl::StrCat(kEntryMagic, "\n", base::Sha256Hex(body), "\n", body));
}

absl::StatusOr<v1::EmitPtxArtifact> PtxCache::GetOrFetch(const std::string& key, const Fetch& fetch,
                                                         std::string* notes) {
  absl::StatusOr<v1::EmitPtxArtifact> cached = Read(key);
  if (cached.ok()) return cached;
  // One process fetches a key; the others wait here and then find it written.
  FileLock lock(absl::StrCat(dir_, "/locks/", base::Sha256Hex(key)));
  cached = Read(key);
  if (cached.ok()) return cached;
  if (cached.status().code() == absl::StatusCode::kDataLoss) {
    absl::StrAppend(notes, "normgrad: cache entry corrupt (", cached.status().message(),
                    "); fetching it again\n");
  }
  absl::StatusOr<v1::EmitPtxArtifact> fetched = fetch();
  if (!fetched.ok()) return fetched;
  // The server's digests are checked before anything is stored.
  if (base::Sha256Hex(fetched->ptx()) != fetched->digest().sha256() ||
      (fetched->has_cubin_digest() &&
       base::Sha256Hex(fetched->cubin()) != fetched->cubin_digest().sha256())) {
    return absl::DataLossError("the server's PTX or cubin does not match its digest");
  }
  if (fetched->resource_usage_unknown().empty()) {
    if (absl::Status s = Write(key, *fetched); !s.ok()) {
      absl::StrAppend(notes, "normgrad: ", s.message(), " (not cached)\n");
    }
  }
  return fetched;
}

}  // namespace normgrad::tools
