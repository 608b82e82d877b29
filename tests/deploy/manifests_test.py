#!/usr/bin/python3
"""Renders every kustomize overlay and checks it agrees with the server and the Dockerfile.

Usage: manifests_test.py REPO_ROOT NORMGRAD_SERVER_BINARY
Checks: probes target a port the server listens on (gRPC health), container ports match the
server's --listen / --metrics-listen flags and the Prometheus annotations, every flag passed is
one the server knows, terminationGracePeriodSeconds covers preStop + --shutdown-grace, the GPU
request is present on GPU overlays only, the securityContext is restrictive, the Services
select the Deployment's pods, and the Dockerfile exposes the same ports.
Exit 77 (ctest SKIP) when kubectl is missing.
"""
import re
import shutil
import subprocess
import sys
import unittest

import yaml

ROOT = sys.argv[1] if len(sys.argv) > 1 else "."
SERVER = sys.argv[2] if len(sys.argv) > 2 else "build/bin/normgrad-server"
OVERLAYS = {"base": True, "overlays/gpu": True, "overlays/cpu": False}  # -> wants a GPU


def render(overlay):
    out = subprocess.run(["kubectl", "kustomize", f"{ROOT}/deploy/k8s/{overlay}"],
                         check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def server_flags():
    text = subprocess.run([SERVER, "--helpfull"], capture_output=True, text=True)
    # The server accepts --a-b and --a_b alike; --helpfull prints the underscore spelling.
    return {f.replace("_", "-") for f in re.findall(r"--([a-z0-9_\-]+)", text.stdout + text.stderr)}


def parse_duration_seconds(text):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", text)
    assert m, f"cannot parse duration {text!r}"
    scale = {"ms": 0.001, "s": 1, "m": 60, None: 1}[m.group(2)]
    return float(m.group(1)) * scale


def flag_map(args):
    flags = {}
    for a in args:
        assert a.startswith("--") and "=" in a, f"argument {a!r} is not --flag=value"
        k, v = a[2:].split("=", 1)
        flags[k] = v
    return flags


def port_of(addr):
    return int(addr.rsplit(":", 1)[1])


class ManifestTest(unittest.TestCase):
    known_flags = None

    @classmethod
    def setUpClass(cls):
        cls.known_flags = server_flags()
        assert "listen" in cls.known_flags, f"{SERVER} --helpfull lists no --listen flag"

    def check_overlay(self, overlay, wants_gpu):
        docs = render(overlay)
        kinds = {d["kind"] for d in docs}
        self.assertTrue({"Deployment", "Service", "PodDisruptionBudget"} <= kinds, kinds)
        dep = next(d for d in docs if d["kind"] == "Deployment")
        pod = dep["spec"]["template"]
        spec = pod["spec"]
        c = spec["containers"][0]
        flags = flag_map(c["args"])
        for k in flags:
            self.assertIn(k, self.known_flags, f"{overlay}: server has no flag --{k}")

        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        self.assertEqual(ports["grpc"], port_of(flags["listen"]))
        self.assertEqual(ports["metrics"], port_of(flags["metrics-listen"]))
        ann = pod["metadata"]["annotations"]
        self.assertEqual(ann["prometheus.io/scrape"], "true")
        self.assertEqual(int(ann["prometheus.io/port"]), ports["metrics"])

        # Probes: native gRPC probes (plaintext) on the health port, which is the gRPC port
        # unless TLS moved health to --health-listen.
        health_port = port_of(flags.get("health-listen", flags["listen"]))
        if "tls-cert" in flags:
            self.assertIn("health-listen", flags, "TLS needs a plaintext health port for probes")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            self.assertIn("grpc", c[probe], f"{overlay}: {probe} is not a gRPC probe")
            self.assertEqual(c[probe]["grpc"]["port"], health_port, f"{overlay}: {probe}")

        # Shutdown: preStop sleep, then the server drains for --shutdown-grace.
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        self.assertEqual(pre_stop[0], "sleep")
        needed = float(pre_stop[1]) + parse_duration_seconds(flags["shutdown-grace"])
        self.assertGreaterEqual(spec["terminationGracePeriodSeconds"], needed)

        res = c["resources"]
        self.assertIn("memory", res["limits"])
        self.assertIn("cpu", res["requests"])
        has_gpu = "nvidia.com/gpu" in res.get("limits", {})
        self.assertEqual(has_gpu, wants_gpu, f"{overlay}: GPU request")
        self.assertEqual(flags["backend"], "cuda" if wants_gpu else "cpu")

        psc, csc = spec["securityContext"], c["securityContext"]
        self.assertTrue(psc["runAsNonRoot"])
        self.assertNotEqual(psc.get("runAsUser", 0), 0)
        self.assertFalse(csc["allowPrivilegeEscalation"])
        self.assertTrue(csc["readOnlyRootFilesystem"])
        self.assertEqual(csc["capabilities"]["drop"], ["ALL"])

        selector = dep["spec"]["selector"]["matchLabels"]
        services = [d for d in docs if d["kind"] == "Service"]
        self.assertTrue(any(s["spec"].get("clusterIP") == "None" for s in services), "headless")
        self.assertTrue(any(s["spec"].get("type") == "ClusterIP" for s in services), "ClusterIP")
        for s in services:
            self.assertEqual(s["spec"]["selector"], selector, s["metadata"]["name"])
            for p in s["spec"]["ports"]:
                self.assertIn(p["targetPort"], ports, f"{s['metadata']['name']}: {p}")
        pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
        self.assertEqual(pdb["spec"]["selector"]["matchLabels"], selector)
        return flags

    def test_base(self):
        self.check_overlay("base", True)

    def test_gpu_overlay_with_tls(self):
        flags = self.check_overlay("overlays/gpu", True)
        for k in ("tls-cert", "tls-key", "tls-client-ca"):
            self.assertTrue(flags[k].startswith("/etc/normgrad/tls/"), k)

    def test_cpu_overlay(self):
        self.check_overlay("overlays/cpu", False)

    def test_dockerfile_agrees(self):
        with open(f"{ROOT}/Dockerfile") as f:
            text = f.read()
        exposed = set(int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split())
        cmd = re.search(r"^CMD (\[.+\])$", text, re.M).group(1)
        flags = flag_map(re.findall(r'"(--[a-z\-]+=[^"]+)"', cmd))
        self.assertEqual(exposed, {port_of(flags["listen"]), port_of(flags["metrics-listen"])})
        for k in flags:
            self.assertIn(k, self.known_flags, f"Dockerfile: server has no flag --{k}")
        hc = re.search(r"HEALTHCHECK .*\n\s*CMD (.+)", text).group(1)
        self.assertIn(f":{port_of(flags['listen'])}", hc)
        self.assertIn("USER 10001", text)


if __name__ == "__main__":
    if shutil.which("kubectl") is None:
        print("SKIP: kubectl not found on PATH")
        sys.exit(77)
    unittest.main(argv=[sys.argv[0], "-v"])
