#!/usr/bin/env python3
"""Sorts ThreadSanitizer reports from the tests that cross gRPC (scripts/dev.sh, stage tsan).

    tests/tsan/triage.py SOURCE_ROOT LOG_FILE_OR_DIR...   (TSan's log_path files)

Debian's libgrpc is not built with -fsanitize=thread: the ordering it gives between starting an
operation and running its reaction, or between constructing a reactor and using it, is invisible
to TSan, so its own header code (CallOpSet, CallbackWithSuccessTag, ...) reports races against
itself. This script fails (exit 1) on every report in which both racing accesses were made by
our code (the first frame of each stack outside std::, absl:: and protobuf headers lies in a
source file of this repository, not in the build tree), and on any other kind of report
(lock-order inversion, use after free, ...) whose first stack is ours. Reports with one access
in gRPC's code are counted and their kinds listed, not failed: docs/testing.md explains why.
"""
import collections
import os
import re
import sys

SKIP_LOCATIONS = ('/usr/include/c++/', '/usr/include/absl/', '/usr/include/google/protobuf/',
                  'libsanitizer/')


def frame_owner(line, root):
    """'ours', 'lib' or 'skip' for one '#N function location (module+0x..)' line."""
    tokens = line.strip().split(' ')
    if len(tokens) < 4:
        return 'skip', ''
    location, module = tokens[-2], tokens[-1]
    function = ' '.join(tokens[1:-2])
    if any(s in location for s in SKIP_LOCATIONS) or 'libtsan' in module or 'libstdc++' in module:
        return 'skip', function
    path = location.split(':')[0]
    if path.startswith(root + '/') and not path[len(root) + 1:].startswith('build'):
        # Inlined frames carry a bare name: the file and line say where the access was.
        return 'ours', f'{function[:80]} ({location[len(root) + 1:]})'
    return 'lib', function


def stack_owner(lines, root):
    for line in lines:
        if not re.match(r'\s+#\d+ ', line):
            continue
        owner, function = frame_owner(line, root)
        if owner != 'skip':
            return owner, function
    return 'unknown', ''


def reports(text):
    for chunk in text.split('WARNING: ThreadSanitizer: ')[1:]:
        kind = chunk.split('\n', 1)[0].split(' (pid=')[0]
        body = chunk.split('\nSUMMARY:')[0]
        sections = re.split(r'\n\n|\n  (?=[A-Z])', body)
        stacks = [s.split('\n') for s in sections
                  if re.match(r'\s*(Previous )?(Atomic )?(atomic )?(read|write|Read|Write)', s)]
        if not stacks:
            stacks = [s.split('\n') for s in sections if re.search(r'\n\s+#0 ', '\n' + s)]
        yield kind, stacks


def main():
    root = os.path.realpath(sys.argv[1])
    ours, theirs = collections.Counter(), collections.Counter()
    total = 0
    paths = []
    for arg in sys.argv[2:]:
        if os.path.isdir(arg):
            paths += sorted(os.path.join(arg, n) for n in os.listdir(arg))
        else:
            paths.append(arg)
    for path in paths:
        with open(path, errors='replace') as f:
            text = f.read()
        for kind, stacks in reports(text):
            total += 1
            owners = [stack_owner(s, root) for s in stacks[:2]]
            label = kind + ': ' + ' | '.join((f if o == 'ours' else f[:110]) or '?'
                                             for o, f in owners)
            if kind.startswith('data race'):
                failing = len(owners) == 2 and all(o == 'ours' for o, _ in owners)
            else:
                failing = bool(owners) and owners[0][0] == 'ours'
            (ours if failing else theirs)[label] += 1
    print(f'tsan triage: {total} reports; {sum(ours.values())} between accesses of our own code '
          f'(fail), {sum(theirs.values())} with an access inside gRPC (counted)')
    for label, n in theirs.most_common(8):
        print(f'  counted {n:4d}  {label}')
    for label, n in ours.most_common():
        print(f'  FAIL    {n:4d}  {label}')
    return 1 if ours else 0


if __name__ == '__main__':
    sys.exit(main())
