#!/usr/bin/env python3
"""Dependencies between the repository's folders point one way, everywhere.

Every #include line of a .h or .cc file in base/, nvidia/, kernels/, server/, client/, python/
and tests/ that names code of this repository (or gRPC) must name a folder its own folder may
depend on, per the table below (the floor plan of docs/architecture.md):

  base           status macros, hashing, quoting: what every component may use
  nvidia         the NVIDIA loaders (driver API, nvJitLink), over base
  kernels        the kernel interface, over kernels/ptx (the PTX toolchain, over base);
                 kernels/rmsnorm (the kernels) over both; kernels/tools also nvidia
  proto          the generated normgrad.v1 messages
  server/...     the service, folder by folder (PRODUCT below)
  client         the public client headers (client/include/normgrad); client/src, client/tools
  python         the Python module, over the client
  tests/...      any product folder, its own folder and the shared test folders (TEST_SHARED)

A product folder never includes tests/. Fails naming each offending include with its file and
line. The product table must have no cycle, and a new folder needs a row. Third-party and
standard headers other than gRPC's are not checked.

Before the real tree, the check runs on a made-up tree with an upward include in each floor, and
fails if one is not reported (so a check that silently stopped working cannot pass).

    include_direction_test.py REPO_ROOT
"""

import os
import re
import sys
import tempfile

# folder -> the folders (or "proto", "grpc") its #include lines may name.
PRODUCT = {
    "base": set(),
    "nvidia": {"base"},
    "kernels/ptx": {"base"},
    "kernels": {"base", "kernels/ptx"},
    "kernels/rmsnorm": {"base", "kernels", "kernels/ptx"},
    "kernels/tools": {"base", "kernels", "kernels/ptx", "kernels/rmsnorm", "nvidia"},
    "proto": set(),
    "server/cache": {"base"},
    "server/thread_pool": set(),
    "server/backend": {"base", "kernels", "server/cache", "server/host_rows"},
    "server/host_rows": {"base", "kernels"},
    "server/cpu": {"base", "kernels", "server/backend", "server/host_rows", "server/thread_pool"},
    "server/cuda": {"base", "kernels", "nvidia", "server/backend", "server/cache",
                    "server/host_rows"},
    "server/backend_factory": {"base", "server/backend", "server/cpu", "server/cuda"},
    "server/metrics": {"base"},
    "server/proto_conversion": {"base", "kernels", "proto", "server/backend", "server/cache"},
    "server/ptx": {"base", "kernels", "nvidia", "proto", "server/cache",
                   "server/proto_conversion"},
    "server/listen_socket": set(),
    "server/shared_memory": {"proto", "server/listen_socket"},
    "server/service": {"base", "kernels", "proto", "grpc", "server/backend", "server/cache",
                       "server/metrics", "server/proto_conversion", "server/ptx",
                       "server/shared_memory", "server/thread_pool"},
    "server/process": {"base", "kernels", "nvidia", "proto", "grpc", "server/backend",
                       "server/backend_factory", "server/cache", "server/metrics", "server/ptx",
                       "server/service", "server/shared_memory", "server/thread_pool",
                       "server/listen_socket", "server/proto_conversion"},
    "server": {"grpc", "server/process"},  # main.cc
    "client": {"proto"},
    "client/src": {"base", "proto", "grpc", "client"},
    "client/tools": {"base", "proto", "grpc", "client", "client/src"},
    "python": {"base", "proto", "grpc", "client", "client/src"},
}
# A folder that may include kernels/ may include its rooms (the rooms keep their own order).
for folder, deps in PRODUCT.items():
    if "kernels" in deps and not folder.startswith("kernels"):
        deps |= {"kernels/ptx", "kernels/rmsnorm"}
# Test folders every test folder may include (utilities, the PTX interpreter and its driver).
TEST_SHARED = {"tests/common", "tests/ptxsim", "tests/kernels", "tests/server/service",
               "tests/server/backend"}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
CHECKED_TOP_FOLDERS = ("base", "nvidia", "kernels", "server", "client", "python", "tests")


def component(path):
    """The folder an included path (or a file of the tree) belongs to; None when not ours."""
    parts = path.split("/")
    top = parts[0]
    if top in ("grpcpp", "grpc"):
        return "grpc"
    if top == "normgrad" and len(parts) > 1:
        return "proto" if parts[1] == "v1" else "client"
    if len(parts) < 2:
        return None
    if top in ("base", "nvidia", "proto", "python"):
        return top
    if top == "kernels":
        room = parts[1] in ("tools", "ptx", "rmsnorm") and len(parts) > 2
        return "kernels/" + parts[1] if room else "kernels"
    if top == "server":
        return "/".join(parts[:2]) if len(parts) > 2 else "server"
    if top == "client":
        return "client" if parts[1] == "include" else "client/" + parts[1]
    if top == "tests":
        depth = 3 if parts[1] == "server" and len(parts) > 3 else 2
        return "/".join(parts[:depth]) if len(parts) > depth else "tests"
    return None


def allowed_for(folder):
    """What `folder` may include, or None for a folder without a row."""
    if folder.startswith("tests"):
        return set(PRODUCT) | {"grpc"} | TEST_SHARED
    return PRODUCT.get(folder)


def cycle_in(table):
    """A dependency cycle among the folders of `table`, or None."""
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for dep in sorted(table.get(node, ())):
            if dep not in table:
                continue
            if state.get(dep) == "open":
                return trail + [node, dep]
            if dep not in state:
                found = visit(dep, trail + [node])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(table):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def violations(root):
    problems = []
    for top in CHECKED_TOP_FOLDERS:
        for directory, subdirs, files in os.walk(os.path.join(root, top)):
            subdirs.sort()
            for name in sorted(files):
                if not name.endswith((".h", ".cc")):
                    continue
                file_path = os.path.join(directory, name)
                relative = os.path.relpath(file_path, root).replace(os.sep, "/")
                folder = component(relative)
                allowed = allowed_for(folder)
                if allowed is None:
                    problems.append(f"{relative}: folder {folder} has no row in PRODUCT "
                                    f"(tests/include_direction_test.py)")
                    continue
                with open(file_path, encoding="utf-8", errors="replace") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        target = component(m.group(2))
                        if target is None or target == folder or target in allowed:
                            continue
                        names = ", ".join(sorted(allowed)) or "nothing of ours"
                        problems.append(f"{relative}:{number}: {line.strip()}: {folder} may not "
                                        f"depend on {target} (it may include: {names})")
    return problems


def self_test():
    """The check must report an upward include on every floor of a made-up tree."""
    upward = {
        "base/a.h": '#include "kernels/kernel_config.h"\n',
        "kernels/b.h": '#include "base/status_macros.h"\n#include "nvidia/nvjitlink.h"\n',
        "kernels/tools/c.cc": '#include "server/cuda/cuda_backend.h"\n',
        "server/backend/d.h": '#include "server/cache/module_cache.h"\n'
                              '#include "server/service/normgrad_service.h"\n',
        "client/src/e.cc": '#include "normgrad/client.h"\n#include "server/process/x.h"\n',
        "python/src/f.cc": '#include "tests/common/child_process.h"\n',
        "tests/client/g.cc": '#include "tests/client/test_server.h"\n'
                             '#include "tests/soak/soak.h"\n',
        "server/metrics/h.h": '#include <grpcpp/grpcpp.h>\n',
    }
    expected = ["base/a.h:1:", "client/src/e.cc:2:", "kernels/b.h:2:", "kernels/tools/c.cc:1:",
                "python/src/f.cc:1:", "server/backend/d.h:2:", "server/metrics/h.h:1:",
                "tests/client/g.cc:2:"]
    with tempfile.TemporaryDirectory() as root:
        for path, text in upward.items():
            os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
            with open(os.path.join(root, path), "w") as f:
                f.write(text)
        found = sorted(violations(root))
        starts = [p.split(" ", 1)[0] for p in found]
        if starts != expected:
            return [f"self-test: expected reports at {expected!r}, got {found!r}"]
    if cycle_in({"server/a": {"server/b"}, "server/b": {"server/a"}}) is None:
        return ["self-test: the cycle check missed server/a <-> server/b"]
    return []


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    problems = self_test()
    cycle = cycle_in(PRODUCT)
    if cycle:
        problems.append("PRODUCT has a cycle: " + " -> ".join(cycle))
    problems += violations(root)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} include(s) against the direction of the dependencies "
              "(docs/architecture.md)")
        return 1
    print(f"every include follows the dependency table ({len(PRODUCT)} product folders, "
          f"{', '.join(CHECKED_TOP_FOLDERS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
