#!/usr/bin/python3
"""Renders every kustomize overlay and checks it agrees with the server and the Dockerfile.

Usage: manifests_test.py REPO_ROOT NORMGRAD_SERVER_BINARY
Checks: probes target a port the server listens on (gRPC health), container ports match the
server's --listen / --metrics-listen flags and the Prometheus annotations, every flag passed is
one the server knows, terminationGracePeriodSeconds covers preStop + --shutdown-grace, the GPU
request is present on GPU overlays only, the securityContext is restrictive, the Services
select the Deployment's pods, and the Dockerfile exposes the same ports.
Posture (docs/security.md, "Deployment posture"): no client-facing Service exposes the metrics
port (a metrics-only Service does); a NetworkPolicy admits gRPC only from selected pods and
metrics only from a selected namespace; mutual TLS (--tls-client-ca) only in overlays with the
mtls component; the image is a pinned tag (the project version), never `latest`; requests and
limits are set and requests <= limits; the HorizontalPodAutoscaler scales the Deployment on a
gauge the server really exports (scraped from a running normgrad-server), with a target below
the limit that gauge is bounded by, and docs/operations.md documents it.
The sidecar overlay (server and trainer in one pod on a unix socket with shared memory) is
checked apart, down to starting the server with its rendered args and running its probe.
Exit 77 (ctest SKIP) when kubectl is missing.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
import urllib.request

import yaml

ROOT = sys.argv[1] if len(sys.argv) > 1 else "."
SERVER = sys.argv[2] if len(sys.argv) > 2 else "build/bin/normgrad-server"
OVERLAYS = {"base": True, "overlays/gpu": True, "overlays/gpu-tls": True,
            "overlays/cpu": False}  # -> wants a GPU
CLIENT_FACING_SERVICES = {"normgrad", "normgrad-headless"}


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


def quantity(q):
    """A Kubernetes quantity ("500m", "4", "8Gi", "1G") as a float."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(q))
    assert m, f"cannot parse quantity {q!r}"
    scale = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10,
             "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m.group(2)]
    return float(m.group(1)) * scale


def project_version():
    with open(f"{ROOT}/CMakeLists.txt") as f:
        return re.search(r"project\(normgrad VERSION ([0-9.]+)", f.read()).group(1)


def exported_gauges():
    """The gauges a real normgrad-server exports: started on loopback, /metrics scraped once."""
    proc = subprocess.Popen([SERVER, "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0",
                             "--backend=cpu", "--cpu-threads=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"metrics=127\.0\.0\.1:(\d+)", line)
        assert m, f"no ready line from {SERVER}: {line!r}"
        text = urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/metrics", timeout=10).read()
        return set(re.findall(r"^# TYPE (\S+) gauge$", text.decode(), re.M))
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def ports_admitted(policy, port_names):
    """The `from` lists of the ingress rules that admit one of port_names (or every port)."""
    froms = []
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        if ports is None or any(p.get("port") in port_names for p in ports):
            froms.append(rule.get("from"))
    return froms


class ManifestTest(unittest.TestCase):
    known_flags = None

    @classmethod
    def setUpClass(cls):
        cls.known_flags = server_flags()
        assert "listen" in cls.known_flags, f"{SERVER} --helpfull lists no --listen flag"
        cls.gauges = exported_gauges()
        assert "normgrad_inflight_streams" in cls.gauges, cls.gauges
        with open(f"{ROOT}/docs/operations.md") as f:
            cls.operations_doc = f.read()

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
        # A failed or hung GPU ends the process (exit 3): the bound on device work stays on, and
        # the container is restarted.
        if flags.get("backend", "auto") != "cpu":
            self.assertNotIn(flags.get("device-timeout", "60s"), ("0", "0s", "0ms"),
                             f"{overlay}: --device-timeout=0 leaves a hung GPU serving")
        self.assertEqual(spec.get("restartPolicy", "Always"), "Always", overlay)

        # Shutdown: preStop sleep, then the server drains for --shutdown-grace.
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        self.assertEqual(pre_stop[0], "sleep")
        needed = float(pre_stop[1]) + parse_duration_seconds(flags["shutdown-grace"])
        self.assertGreaterEqual(spec["terminationGracePeriodSeconds"], needed)

        res = c["resources"]
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                self.assertIn(r, res[kind], f"{overlay}: resources.{kind}.{r}")
        for r, want in res["requests"].items():
            self.assertLessEqual(quantity(want), quantity(res["limits"][r]),
                                 f"{overlay}: request {r} above its limit")

        # A pinned image: with IfNotPresent a `latest` tag is whatever a node pulled first.
        image = c["image"]
        self.assertRegex(image, r":[^/]+$", f"{overlay}: image without a tag")
        tag = image.rsplit(":", 1)[1]
        self.assertNotEqual(tag, "latest", f"{overlay}: image tag `latest`")
        self.assertEqual(tag, project_version(), f"{overlay}: image tag is not the project version")
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
        metrics_services = []
        for s in services:
            name = s["metadata"]["name"]
            self.assertEqual(s["spec"]["selector"], selector, name)
            targets = set()
            for p in s["spec"]["ports"]:
                self.assertIn(p["targetPort"], ports, f"{name}: {p}")
                targets.add(p["targetPort"])
            if name in CLIENT_FACING_SERVICES:
                self.assertNotIn("metrics", targets, f"{overlay}: {name} exposes the metrics port")
                self.assertNotIn(ports["metrics"], targets, f"{overlay}: {name} exposes metrics")
            elif "metrics" in targets:
                self.assertEqual(targets, {"metrics"}, f"{overlay}: {name} mixes metrics and gRPC")
                metrics_services.append(name)
            else:
                self.fail(f"{overlay}: Service {name} is neither client-facing nor metrics-only")
        self.assertTrue(metrics_services, f"{overlay}: no metrics-only Service for Prometheus")

        # NetworkPolicy: the pods' gRPC port admitted from selected pods only, metrics from a
        # selected namespace only; never an empty `from` (everyone).
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        self.assertTrue(policies, f"{overlay}: no NetworkPolicy")
        policy = next((p for p in policies if p["spec"]["podSelector"].get("matchLabels") == selector),
                      None)
        self.assertIsNotNone(policy, f"{overlay}: no NetworkPolicy selects the Deployment's pods")
        self.assertIn("Ingress", policy["spec"]["policyTypes"])
        grpc_from = ports_admitted(policy, {"grpc", ports["grpc"]})
        self.assertTrue(grpc_from, f"{overlay}: the NetworkPolicy admits no client to gRPC")
        for peers in grpc_from:
            self.assertTrue(peers, f"{overlay}: gRPC admitted from anywhere")
            for peer in peers:
                self.assertNotIn("ipBlock", peer, f"{overlay}: gRPC admitted from an ipBlock")
                self.assertTrue(peer.get("podSelector"), f"{overlay}: gRPC from unselected pods")
        for peers in ports_admitted(policy, {"metrics", ports["metrics"]}):
            self.assertTrue(peers, f"{overlay}: metrics admitted from anywhere")
            for peer in peers:
                self.assertTrue(peer.get("namespaceSelector") or peer.get("podSelector"),
                                f"{overlay}: metrics from an unselected peer")

        # Autoscaling on a gauge the server exports, bounded by a limit in its flags.
        hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
        self.assertEqual(len(hpas), 1, f"{overlay}: HorizontalPodAutoscaler")
        hpa = hpas[0]["spec"]
        self.assertEqual((hpa["scaleTargetRef"]["kind"], hpa["scaleTargetRef"]["name"]),
                         ("Deployment", dep["metadata"]["name"]))
        self.assertGreaterEqual(hpa["minReplicas"], 2, "one replica cannot drain without an outage")
        self.assertLessEqual(hpa["minReplicas"], dep["spec"]["replicas"])
        self.assertGreaterEqual(hpa["maxReplicas"], dep["spec"]["replicas"])
        self.assertGreater(hpa["maxReplicas"], hpa["minReplicas"])
        bound_by = {"normgrad_inflight_streams": "max-streams",
                    "normgrad_inflight_bytes": "max-inflight-bytes"}
        for m in hpa["metrics"]:
            self.assertEqual(m["type"], "Pods", f"{overlay}: HPA metric {m}")
            name = m["pods"]["metric"]["name"]
            self.assertIn(name, self.gauges, f"{overlay}: the server exports no gauge {name}")
            self.assertIn(name, bound_by, f"{overlay}: {name} is not a load gauge")
            target = quantity(m["pods"]["target"]["averageValue"])
            self.assertGreater(target, 0)
            self.assertLess(target, float(flags[bound_by[name]]),
                            f"{overlay}: HPA target {target} is not below --{bound_by[name]}")
            self.assertIn(name, self.operations_doc, "docs/operations.md does not name the metric")
        pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
        self.assertEqual(pdb["spec"]["selector"]["matchLabels"], selector)
        return flags

    def test_base(self):
        self.check_overlay("base", True)

    def test_gpu_overlay_with_mutual_tls(self):
        flags = self.check_overlay("overlays/gpu", True)
        for k in ("tls-cert", "tls-key", "tls-client-ca"):
            self.assertTrue(flags[k].startswith("/etc/normgrad/tls/"), k)

    def test_gpu_overlay_with_server_tls_needs_no_ca(self):
        # A standard kubernetes.io/tls Secret has no ca.crt: --tls-client-ca would crash-loop.
        flags = self.check_overlay("overlays/gpu-tls", True)
        for k in ("tls-cert", "tls-key"):
            self.assertTrue(flags[k].startswith("/etc/normgrad/tls/"), k)
        self.assertNotIn("tls-client-ca", flags)

    def test_plaintext_overlays_have_no_tls_flags(self):
        for overlay in ("base", "overlays/cpu"):
            flags = self.check_overlay(overlay, overlay == "base")
            self.assertFalse({"tls-cert", "tls-client-ca"} & set(flags), overlay)

    def test_cpu_overlay(self):
        self.check_overlay("overlays/cpu", False)

    def test_mtls_only_from_its_component(self):
        for path in ("base", "components/tls"):
            for dirpath, _, files in os.walk(f"{ROOT}/deploy/k8s/{path}"):
                for name in files:
                    with open(os.path.join(dirpath, name)) as f:
                        text = "".join(line for line in f if not line.lstrip().startswith("#"))
                    self.assertNotIn("--tls-client-ca", text, os.path.join(dirpath, name))

    def test_sidecar_overlay(self):
        """The server beside a trainer in one pod: a unix socket in a memory-backed volume both
        containers mount, shared memory on, no gRPC port on the pod network, probes on the
        socket; and the server's exact args start a server those probes find SERVING."""
        docs = render("overlays/sidecar")
        kinds = [d["kind"] for d in docs]
        for gone in ("HorizontalPodAutoscaler", "PodDisruptionBudget"):
            self.assertNotIn(gone, kinds)
        services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
        self.assertEqual(services, {"normgrad-metrics"})
        dep = next(d for d in docs if d["kind"] == "Deployment")
        spec = dep["spec"]["template"]["spec"]
        containers = {c["name"]: c for c in spec["containers"]}
        server, trainer = containers["normgrad"], containers["trainer"]
        args = server["args"]
        for a in args:
            name = a[2:].split("=", 1)[0]
            self.assertIn(name, self.known_flags, f"sidecar: server has no flag --{name}")
        listens = [a.split("=", 1)[1] for a in args if a.startswith("--listen=")]
        self.assertEqual(len(listens), 1, listens)
        self.assertTrue(listens[0].startswith("unix:"), listens)
        path = listens[0][len("unix:"):]
        self.assertIn("--shared-memory", args)
        socket_dir = os.path.dirname(path)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = [next((m["name"] for m in c.get("volumeMounts", [])
                        if m["mountPath"] == socket_dir), None) for c in (server, trainer)]
        self.assertIsNotNone(mounts[0], "the server does not mount the socket directory")
        self.assertEqual(mounts[0], mounts[1], "the trainer does not mount the socket's volume")
        self.assertEqual(volumes[mounts[0]]["emptyDir"].get("medium"), "Memory")
        env = {e["name"]: e.get("value") for e in trainer.get("env", [])}
        self.assertEqual(env.get("NORMGRAD_TARGET"), "unix:" + path)
        self.assertNotIn("grpc", {p["name"] for p in server.get("ports", [])})
        probes = [server[p]["exec"]["command"] for p in
                  ("readinessProbe", "livenessProbe", "startupProbe")]
        for command in probes:
            self.assertEqual(command[:2], ["normgrad", "health"])
            self.assertIn("--target=unix:" + path, command)
        # One pod user for both containers (the socket's 0660 admits the trainer).
        self.assertIn("runAsUser", spec["securityContext"])
        for c in (server, trainer):
            self.assertNotIn("runAsUser", c.get("securityContext", {}), c["name"])
        policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
        self.assertEqual(ports_admitted(policy, {"grpc", "health"}), [],
                         "sidecar: the NetworkPolicy still admits gRPC")

        # The server's args as rendered (the socket in a temporary directory, the CPU backend,
        # metrics on loopback), then the readiness probe's command against it.
        with tempfile.TemporaryDirectory(prefix="ng-sidecar-", dir="/tmp") as tmp:
            local = os.path.join(tmp, "grpc.sock")
            run_args = []
            for a in args:
                a = a.replace(path, local)
                if a.startswith("--backend="):
                    a = "--backend=cpu"
                elif a.startswith("--metrics-listen="):
                    a = "--metrics-listen=127.0.0.1:0"
                run_args.append(a)
            proc = subprocess.Popen([SERVER] + run_args, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
            try:
                line = proc.stdout.readline()
                self.assertIn(f" unix={local}", line)
                self.assertIn(f" shm={local}.shm", line)
                probe = [os.path.join(os.path.dirname(SERVER), "normgrad")] + [
                    c.replace(path, local) for c in probes[0][1:]]
                result = subprocess.run(probe, capture_output=True, text=True, timeout=30)
                self.assertEqual(result.returncode, 0, result.stderr)
                self.assertEqual(result.stdout.strip(), "SERVING")
            finally:
                proc.terminate()
                proc.wait(timeout=60)
                proc.stdout.close()

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
        # Docker's builder would fetch a frontend image for a `# syntax=` line; none is needed.
        self.assertNotRegex(text, r"(?m)^#\s*syntax=")
        # docker stop's default 10 s is shorter than the drain: the image says SIGTERM and the
        # docs say how long to wait.
        self.assertRegex(text, r"(?m)^STOPSIGNAL SIGTERM$")
        # nvJitLink copied once, by name (a glob copies the symlink's target twice), and no
        # --nvjitlink needed: the Kubernetes args replace the CMD.
        copies = re.findall(r"(?m)^COPY .*libnvJitLink.*$", text)
        self.assertEqual(len(copies), 1, copies)
        self.assertNotIn("*", copies[0])
        self.assertNotIn("--nvjitlink", cmd)
        with open(f"{ROOT}/.dockerignore") as f:
            ignored = {line.strip() for line in f if line.strip() and not line.startswith("#")}
        self.assertTrue({".git", "build", "build-*"} <= ignored, ignored)


if __name__ == "__main__":
    if shutil.which("kubectl") is None:
        print("SKIP: kubectl not found on PATH")
        sys.exit(77)
    unittest.main(argv=[sys.argv[0], "-v"])
