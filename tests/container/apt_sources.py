#!/usr/bin/env python3
"""The machine's own Debian apt sources for one suite, for a debootstrapped base image.

  apt_sources.py mirror CODENAME      print the first `deb` URI that serves CODENAME
  apt_sources.py deb822 CODENAME      print deb822 stanzas for CODENAME, CODENAME-updates and
                                      CODENAME-security, as the machine has them

Reads /etc/apt/sources.list, /etc/apt/sources.list.d/*.list and *.sources (one-line and deb822
formats; disabled entries and files with other suffixes are skipped). No mirror is hard-coded:
the image gets whatever this machine is configured to use, so it works behind any mirror or proxy.
Exits 1 when no entry serves CODENAME.
"""
import glob
import os
import sys

APT = os.environ.get("APT_ETC", "/etc/apt")


def entries():
    """Yield (types, uris, suites, components, options) for every enabled entry."""
    one_line = [os.path.join(APT, "sources.list")] + sorted(glob.glob(os.path.join(APT, "sources.list.d", "*.list")))
    for path in one_line:
        if not os.path.isfile(path):
            continue
        for line in open(path, encoding="utf-8", errors="replace"):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            words = line.split()
            options = {}
            if len(words) > 1 and words[1].startswith("["):
                opt = []
                rest = words[1:]
                while rest:
                    w = rest.pop(0)
                    opt.append(w)
                    if w.endswith("]"):
                        break
                for kv in " ".join(opt).strip("[] ").split():
                    if "=" in kv:
                        k, v = kv.split("=", 1)
                        options[k.lower()] = v
                words = [words[0]] + rest
            if len(words) < 3:
                continue
            yield [words[0]], [words[1]], [words[2]], words[3:], options
    for path in sorted(glob.glob(os.path.join(APT, "sources.list.d", "*.sources"))):
        text = open(path, encoding="utf-8", errors="replace").read()
        for stanza in text.split("\n\n"):
            fields, key = {}, None
            for raw in stanza.splitlines():
                if raw.lstrip().startswith("#"):
                    continue
                if raw[:1] in (" ", "\t") and key:
                    fields[key] += " " + raw.strip()
                    continue
                if ":" in raw:
                    key, value = raw.split(":", 1)
                    key = key.strip().lower()
                    fields[key] = value.strip()
            if not fields.get("uris") or fields.get("enabled", "yes").lower() == "no":
                continue
            options = {k: v for k, v in fields.items() if k in ("signed-by", "trusted", "arch", "architectures")}
            yield (fields.get("types", "deb").split(), fields["uris"].split(),
                   fields.get("suites", "").split(), fields.get("components", "").split(), options)


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("mirror", "deb822"):
        sys.exit(__doc__)
    mode, codename = sys.argv[1], sys.argv[2]
    wanted = {codename, codename + "-updates", codename + "-security"}
    found = []
    for types, uris, suites, components, options in entries():
        if "deb" not in types:
            continue
        suites = [s for s in suites if s in wanted]
        if suites:
            found.append((uris, suites, components or ["main"], options))
    if not found:
        sys.exit(f"no enabled deb entry for {codename} in {APT}/sources.list*")
    if mode == "mirror":
        for uris, suites, _, _ in found:
            if codename in suites:
                print(uris[0])
                return
        sys.exit(f"no enabled deb entry for the suite {codename} itself")
    for uris, suites, components, options in found:
        print("Types: deb")
        print("URIs: " + " ".join(uris))
        print("Suites: " + " ".join(suites))
        print("Components: " + " ".join(components))
        if "signed-by" in options:
            print("Signed-By: " + options["signed-by"])
        print()


if __name__ == "__main__":
    main()
