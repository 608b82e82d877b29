#!/usr/bin/env bash
# Builds abseil's synchronization library, the one gRPC locks with, from Debian's source package
# of the installed abseil, with -fsanitize=thread, into DIR/lib (scripts/dev.sh, stage tsan).
#
#   scripts/tsan_abseil.sh DIR
#
# With DIR/lib first on LD_LIBRARY_PATH, every absl::Mutex lock and unlock inside Debian's gRPC
# becomes visible to ThreadSanitizer; the rest of gRPC stays uninstrumented (docs/testing.md).
# Fetches the source with apt-get from a private apt configuration under DIR: the machine's own
# apt sources (sources.list, sources.list.d/*.list and deb822 *.sources), each deb entry turned
# into a deb-src one, so the source comes from whichever archive or mirror the packages came
# from; nothing on the system changes, no root needed. Reuses DIR/lib when present.
# Exits non-zero when the source cannot be fetched or the result does not export every symbol
# of the installed library.
set -euo pipefail
dir=$(realpath -m "${1:?usage: scripts/tsan_abseil.sh DIR}")
lib="$dir/lib"
installed=$(find /usr/lib /lib -name 'libabsl_synchronization.so.*' -type f 2>/dev/null | head -n 1)
[ -n "$installed" ] || { echo "tsan_abseil: no libabsl_synchronization.so installed" >&2; exit 1; }
soname=$(basename "$(readlink -f "$installed")" | sed 's/\(\.so\.[0-9]*\).*/\1/')
if [ -e "$lib/$soname" ]; then
  echo "tsan_abseil: reusing $lib/$soname"
  exit 0
fi

package=$(dpkg-query -S "$installed" | cut -d: -f1)
read -r source version < <(dpkg-query -W -f='${source:Package} ${source:Version}\n' "$package")
apt_dir="$dir/apt"
rm -rf "$apt_dir" "$dir/src" "$dir/build"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/sources.list.d" \
  "$dir/src"

# The entries the system installs packages from, as apt itself finds them (Dir::Etc::SourceList
# and SourceParts), each made a deb-src entry with its options unchanged. Only deb entries are
# taken: the system's own deb-src entries, if any, may repeat them with other options, which apt
# refuses as a conflict. One-line files: every "deb [opts] URI SUITE COMP..." line. deb822 files:
# every stanza whose Types has "deb", its Types made "deb-src"; every other field (URIs, Suites,
# Components, Signed-By, Enabled) stays as the system has it.
eval "$(apt-config shell system_list Dir::Etc::SourceList/f system_parts Dir::Etc::SourceParts/d)"
one_line_to_src() {
  awk '$1 == "deb" { $1 = "deb-src"; if (!seen[$0]++) print }' "$1"
}
deb822_to_src() {
  awk 'BEGIN { RS = ""; FS = "\n" }
    {
      binary = 0
      stanza = ""
      for (i = 1; i <= NF; i++) {
        line = $i
        if (tolower(substr(line, 1, 6)) == "types:") {
          n = split(substr(line, 7), types, /[ \t]+/)
          for (j = 1; j <= n; j++) if (types[j] == "deb") binary = 1
          line = "Types: deb-src"
        }
        stanza = stanza line "\n"
      }
      if (binary) printf "%s\n", stanza
    }' "$1"
}
touch "$apt_dir/sources.list"
if [ -f "${system_list:-}" ]; then
  one_line_to_src "$system_list" >"$apt_dir/sources.list"
fi
parts=${system_parts:-/nonexistent}
for file in "$parts"/*.list "$parts"/*.sources; do
  [ -f "$file" ] || continue
  case "$file" in
    *.list) one_line_to_src "$file" ;;
    *.sources) deb822_to_src "$file" ;;
  esac >"$apt_dir/sources.list.d/$(basename "$file")"
done
if ! cat "$apt_dir/sources.list" "$apt_dir/sources.list.d"/* 2>/dev/null |
  grep -q -E '^(deb-src |Types: deb-src)'; then
  echo "tsan_abseil: no deb entries in the apt sources (${system_list:-}, $parts)" >&2
  exit 1
fi
apt_options=(-o "Dir::Etc::SourceList=$apt_dir/sources.list"
  -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d" -o "Dir::State::Lists=$apt_dir/lists"
  -o "Dir::Cache=$apt_dir/cache" -o "APT::Sandbox::User=$(id -un)")
echo "tsan_abseil: fetching the source of $source $version"
apt-get "${apt_options[@]}" -qq update
(cd "$dir/src" && apt-get "${apt_options[@]}" -qq source --only-source "$source=$version" >/dev/null)
src=$(find "$dir/src" -mindepth 1 -maxdepth 1 -type d | head -n 1)

# Debian's own configuration (debian/rules: C++17, shared libraries), plus ThreadSanitizer.
cmake -S "$src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_STANDARD=17 \
  -DBUILD_SHARED_LIBS=ON -DABSL_PROPAGATE_CXX_STD=ON -DCMAKE_CXX_FLAGS="-fsanitize=thread -O1 -g" \
  -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread >/dev/null
cmake --build "$dir/build" -j"$(nproc)" --target synchronization >/dev/null

built=$(find "$dir/build" -name "$soname" | head -n 1)
missing=$(comm -23 <(nm -D --defined-only "$installed" | awk '{print $3}' | sort -u) \
                   <(nm -D --defined-only "$built" | awk '{print $3}' | sort -u) | head -n 5)
if [ -n "$missing" ]; then
  echo "tsan_abseil: the rebuilt $soname lacks symbols of the installed one: $missing" >&2
  exit 1
fi
mkdir -p "$lib"
for name in libabsl_synchronization libabsl_graphcycles_internal; do
  cp -a "$(dirname "$built")/$name".so* "$lib/"
done
echo "tsan_abseil: $lib/$soname ($source $version, -fsanitize=thread)"
