#!/usr/bin/env python3
"""Dependencies between the folders of server/ point one way.

Every #include line in server/ that names our own code (server/..., kernels/..., the generated
normgrad/v1/... messages, or anything else of this repository) or gRPC must name a folder its own
folder may depend on, per ALLOWED below (the table of docs/architecture.md). Fails naming each
offending include with its file and line. ALLOWED itself must have no cycle, and a new folder
under server/ needs a row. Third-party and standard headers other than gRPC's are not checked.

Before the real tree, the check runs once on a made-up tree with a backwards include, and fails
if that include is not reported (so a check that silently stopped working cannot pass).

    include_direction_test.py REPO_ROOT
"""

import os
import re
import sys
import tempfile

# folder -> the folders (or "kernels", "proto", "grpc") its #include lines may name.
ALLOWED = {
    "server/cache": {"kernels"},  # kernels/status_macros.h
    "server/thread_pool": set(),
    "server/backend": {"kernels", "server/cache"},
    "server/host_rows": {"kernels"},
    "server/cpu": {"kernels", "server/backend", "server/host_rows", "server/thread_pool"},
    "server/cuda": {"kernels", "server/backend", "server/cache", "server/host_rows"},
    "server/backend_factory": {"server/backend", "server/cpu", "server/cuda"},
    "server/metrics": {"kernels"},  # kernels/status_macros.h
    "server/proto_conversion": {"kernels", "proto", "server/backend", "server/cache"},
    "server/ptx": {"kernels", "proto", "server/cache", "server/cuda", "server/proto_conversion"},
    "server/unix_socket": set(),
    "server/shared_memory": {"proto", "server/unix_socket"},
    "server/service": {"kernels", "proto", "grpc", "server/backend", "server/cache",
                       "server/metrics", "server/proto_conversion", "server/ptx",
                       "server/shared_memory", "server/thread_pool"},
    "server/process": {"kernels", "proto", "grpc", "server/backend", "server/backend_factory",
                       "server/cache", "server/metrics", "server/ptx", "server/service",
                       "server/shared_memory", "server/thread_pool", "server/unix_socket"},
    "server": {"grpc", "server/process"},  # main.cc
}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
OUR_TOP_FOLDERS = ("server", "kernels", "client", "tests", "proto", "deploy", "scripts")


def component(path):
    """What an included path belongs to, or None for headers this check ignores."""
    parts = path.split("/")
    if parts[0] in ("grpcpp", "grpc"):
        return "grpc"
    if parts[0] == "normgrad" and len(parts) > 1 and parts[1] == "v1":
        return "proto"
    if parts[0] == "server":
        return "/".join(parts[:2]) if len(parts) > 2 else "server"
    if parts[0] in OUR_TOP_FOLDERS and len(parts) > 1:
        return parts[0]
    return None


def folder_of(relative_file):
    parts = relative_file.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def cycle_in(table):
    """A dependency cycle among the server/ folders of `table`, or None."""
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
    for directory, _, files in os.walk(os.path.join(root, "server")):
        for name in sorted(files):
            if not name.endswith((".h", ".cc")):
                continue
            file_path = os.path.join(directory, name)
            relative = os.path.relpath(file_path, root).replace(os.sep, "/")
            folder = folder_of(relative)
            if folder not in ALLOWED:
                problems.append(f"{relative}: folder {folder} has no row in ALLOWED "
                                f"(tests/server/include_direction_test.py)")
                continue
            with open(file_path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    target = component(m.group(2))
                    if target is None or target == folder or target in ALLOWED[folder]:
                        continue
                    allowed = ", ".join(sorted(ALLOWED[folder])) or "nothing of ours"
                    spelled = line.strip()
                    problems.append(f"{relative}:{number}: {spelled}: {folder} may not depend "
                                    f"on {target} (it may include: {allowed})")
    return problems


def self_test():
    """The check must report a backwards include in a made-up tree."""
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "server", "backend"))
        with open(os.path.join(root, "server", "backend", "backend.h"), "w") as f:
            f.write('#include "server/cache/module_cache.h"\n'
                    '#include "server/service/normgrad_service.h"\n')
        found = violations(root)
        expected = "server/backend/backend.h:2: #include \"server/service/normgrad_service.h\""
        if len(found) != 1 or not found[0].startswith(expected):
            return [f"self-test: expected one report starting with {expected!r}, got {found!r}"]
    if cycle_in({"server/a": {"server/b"}, "server/b": {"server/a"}}) is None:
        return ["self-test: the cycle check missed server/a <-> server/b"]
    return []


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    problems = self_test()
    cycle = cycle_in(ALLOWED)
    if cycle:
        problems.append("ALLOWED has a cycle: " + " -> ".join(cycle))
    problems += violations(root)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} include(s) against the direction of server/'s dependencies "
              "(docs/architecture.md)")
        return 1
    print(f"server/: every include follows the dependency table ({len(ALLOWED)} folders)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
