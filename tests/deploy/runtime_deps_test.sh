#!/usr/bin/env bash
# The runtime image installs exactly deploy/runtime-packages.txt: check that this is exactly
# the set of Debian packages owning the shared libraries the shipped binaries load.
# Usage: runtime_deps_test.sh REPO_ROOT BINARY...
set -euo pipefail
root=$1; shift
want=$(grep -v '^#' "$root/deploy/runtime-packages.txt" | sed '/^$/d' | sort -u)
libs=$(for b in "$@"; do ldd "$b"; done | awk '/=> \//{print $3} /^\s*\/lib/{print $1}' | sort -u)
# One dpkg -S for every path a library may be listed under (itself, its link target, /usr + it:
# merged-/usr systems list /usr/lib); a call per library took most of the test's time.
candidates=$(for l in $libs; do echo "$l"; readlink -f "$l"; echo "/usr$l"; done | sort -u)
owners=$(dpkg -S $candidates 2>/dev/null || true)  # "package[:arch]: path", the owned ones
have=$(for l in $libs; do
  real=$(readlink -f "$l")
  awk -v a="$l" -v b="$real" -v c="/usr$l" -v lib="$l" '
    { i = index($0, ": "); path = substr($0, i + 2); pkg = substr($0, 1, i - 1)
      if (path == a || path == b || path == c) { print pkg; found = 1; exit } }
    END { if (!found) print "UNOWNED: " lib }' <<<"$owners"
done | sort -u)
if echo "$have" | grep -q UNOWNED; then
  echo "FAIL: libraries owned by no package:"; echo "$have" | grep UNOWNED; exit 1
fi
have=$(echo "$have" | sed 's/:amd64$//' | sort -u)
missing=$(comm -13 <(echo "$want") <(echo "$have"))
extra=$(comm -23 <(echo "$want") <(echo "$have"))
if [ -n "$missing" ] || [ -n "$extra" ]; then
  echo "FAIL: deploy/runtime-packages.txt disagrees with what the binaries load"
  [ -n "$missing" ] && echo "  needed but not listed: $(echo $missing)"
  [ -n "$extra" ] && echo "  listed but not needed: $(echo $extra)"
  exit 1
fi
echo "runtime packages match the binaries' shared libraries: $(echo $want)"
