#!/usr/bin/env python3
"""Checks deploy/k8s and docker/compose.yaml against the server they run: every
PAGEDATTN_* variable is a real pagedattn-server flag, probes hit the plaintext health port,
secret paths match mounted keys, one GPU per pod, a StatefulSet (stable replica names) behind
a headless Service, no service-link variables, a preStop pause and a drain that fit the grace
period.

  python3 tests/scripts/k8s_manifest_test.py build/server/pagedattn-server
"""
import pathlib
import re
import subprocess
import sys

import yaml

root = pathlib.Path(__file__).resolve().parents[2]
server = sys.argv[1]
helptext = subprocess.run([server, "--help"], capture_output=True, text=True, check=True).stdout
flags = set(re.findall(r"^\s+--(\w+) \(default", helptext, re.M))
assert "listen" in flags and "health_listen" in flags, "could not read the server's flags"

docs = {}
for f in sorted((root / "deploy/k8s").glob("*.yaml")):
    for d in yaml.safe_load_all(f.read_text()):
        if d and "kind" in d:
            docs[d["kind"]] = d
for kind in ("StatefulSet", "Service", "ConfigMap", "Secret"):
    assert kind in docs, f"no {kind} in deploy/k8s"

env = docs["ConfigMap"]["data"]
for name, value in env.items():
    flag = name[len("PAGEDATTN_"):].lower()
    assert name.startswith("PAGEDATTN_") and flag in flags, f"{name} is not a server flag"
health_port = int(env["PAGEDATTN_HEALTH_LISTEN"].rsplit(":", 1)[1])

# The sharded overlay: the base, two replicas of the StatefulSet.
overlay = yaml.safe_load((root / "deploy/k8s-sharded/kustomization.yaml").read_text())
assert overlay["resources"] == ["../k8s"], "the sharded overlay must build on deploy/k8s"
assert overlay["replicas"] == [{"name": docs["StatefulSet"]["metadata"]["name"], "count": 2}], \
    "the sharded overlay must scale the StatefulSet to 2"

sts = docs["StatefulSet"]["spec"]
assert sts["serviceName"] == docs["Service"]["metadata"]["name"], "StatefulSet must name the Service"
pod = sts["template"]["spec"]
assert pod.get("enableServiceLinks") is False, "service links inject PAGEDATTN_* variables"
c = pod["containers"][0]
assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1", "one GPU per pod"
for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
    assert c[probe]["grpc"]["port"] == health_port, f"{probe} must use the plaintext health port"
ports = {p["name"]: p["containerPort"] for p in c["ports"]}
assert ports["health"] == health_port
assert ports["grpc"] == int(env["PAGEDATTN_LISTEN"].rsplit(":", 1)[1])
assert ports["metrics"] == int(env["PAGEDATTN_METRICS_LISTEN"].rsplit(":", 1)[1])

# SIGTERM comes after preStop's pause (endpoints drop the terminating pod meanwhile); the
# pause and the server's drain must end before the kubelet's SIGKILL.
pause = c["lifecycle"]["preStop"]["exec"]["command"]
assert pause[0] == "sleep", "preStop pauses with sleep (the server closes its ports at SIGTERM)"
drain = int(env["PAGEDATTN_SHUTDOWN_GRACE_S"])
FORCED_EXIT_AFTER_S = 3  # server/main.cc's kForcedExitAfter: the exit is forced by then
assert int(pause[1]) + drain + FORCED_EXIT_AFTER_S < pod["terminationGracePeriodSeconds"], \
    "preStop's pause, the shutdown grace and the forced exit must fit terminationGracePeriodSeconds"

mount = next(m for m in c["volumeMounts"] if m["name"] == "secret")["mountPath"]
keys = set(docs["Secret"]["stringData"])
for var in ("PAGEDATTN_TLS_CERT", "PAGEDATTN_TLS_KEY", "PAGEDATTN_AUTH_TOKENS_FILE"):
    path = pathlib.PurePosixPath(env[var])
    assert str(path.parent) == mount and path.name in keys, f"{var}={path} is not a mounted secret key"

svc = docs["Service"]["spec"]
assert svc["clusterIP"] == "None", "the Service must be headless"
assert {p["targetPort"] for p in svc["ports"]} <= set(ports), "Service targets an unnamed port"

compose = yaml.safe_load((root / "docker/compose.yaml").read_text())["services"]["pagedattn"]
for name in compose["environment"]:
    assert name[len("PAGEDATTN_"):].lower() in flags, f"compose: {name} is not a server flag"
dev = compose["deploy"]["resources"]["reservations"]["devices"][0]
assert dev["count"] == 1 and "gpu" in dev["capabilities"]
print("k8s_manifest_test: OK")
