#!/usr/bin/env python3
"""Checks that every probe of a dedupd container targets a port the kubelet
can reach.

The kubelet probes the pod IP, never the pod's loopback (a gRPC probe has no
`host` field), so a probe on a port dedupd serves only on 127.0.0.1 never
succeeds in a real cluster, and offline schema validation cannot see that.
For each dedupd container (its image names dedupd) in the given manifests,
each httpGet, tcpSocket or grpc probe must name a port that one of dedupd's
listen addresses (DEDUPD_LISTEN, DEDUPD_METRICS_LISTEN, or --listen and
--metrics-listen in args; dedupd's defaults otherwise; for `dedupd inject`,
DEDUPD_INJECT_LISTEN or --listen) serves on a non-loopback host. exec probes run inside the container and always pass.

    check_probes.py FILE...        exit 1 and one line per bad probe
"""

import ipaddress
import sys

import yaml

DEFAULTS = {"DEDUPD_LISTEN": "127.0.0.1:50051", "DEDUPD_METRICS_LISTEN": "127.0.0.1:9090"}
FLAGS = {"--listen": "DEDUPD_LISTEN", "--metrics-listen": "DEDUPD_METRICS_LISTEN"}
# `dedupd inject` (the webhook) serves one HTTPS port.
INJECT_DEFAULTS = {"DEDUPD_INJECT_LISTEN": "0.0.0.0:8443"}
INJECT_FLAGS = {"--listen": "DEDUPD_INJECT_LISTEN"}


def pod_specs(document):
    """The pod specs in a manifest: a Pod's, or a workload's template's."""
    if not isinstance(document, dict):
        return
    spec = document.get("spec") or {}
    if document.get("kind") == "Pod":
        yield spec
    elif "template" in spec:
        yield (spec["template"] or {}).get("spec") or {}
    elif "jobTemplate" in spec:
        yield from pod_specs({"spec": spec["jobTemplate"].get("spec") or {}})


def listen_settings(container):
    args = [str(arg) for arg in (container.get("command") or []) + (container.get("args") or [])]
    injector = "inject" in args
    defaults, flags = (INJECT_DEFAULTS, INJECT_FLAGS) if injector else (DEFAULTS, FLAGS)
    settings = dict(defaults)
    for variable in container.get("env") or []:
        if variable.get("name") in defaults and "value" in variable:
            settings[variable["name"]] = str(variable["value"])
    for index, arg in enumerate(args):
        for flag, name in flags.items():
            if arg.startswith(flag + "="):
                settings[name] = arg.split("=", 1)[1]
            elif arg == flag and index + 1 < len(args):
                settings[name] = args[index + 1]
    return settings


def reachable_ports(settings):
    """Ports served on an address other than loopback."""
    ports = set()
    for value in settings.values():
        for address in value.split(","):
            address = address.strip()
            if not address or address == "off" or address.startswith("unix:"):
                continue
            host, _, port = address.rpartition(":")
            host = host.strip("[]")
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = host == "localhost"
            if not loopback and port.isdigit():
                ports.add(int(port))
    return ports


def resolve(port, container):
    if isinstance(port, int):
        return port
    for declared in container.get("ports") or []:
        if declared.get("name") == port:
            return declared.get("containerPort")
    return None


def problems(path):
    with open(path, encoding="utf-8") as manifest:
        documents = list(yaml.safe_load_all(manifest))
    for document in documents:
        for spec in pod_specs(document):
            for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
                if "dedupd" not in str(container.get("image", "")):
                    continue
                reachable = reachable_ports(listen_settings(container))
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    probe = container.get(kind)
                    if not probe or "exec" in probe:
                        continue
                    handler = probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc")
                    port = resolve((handler or {}).get("port"), container)
                    if port not in reachable:
                        yield (f"{path}: {document.get('kind')} "
                               f"{(document.get('metadata') or {}).get('name')}, container "
                               f"{container.get('name')}: {kind} targets port {port}, which dedupd "
                               f"serves only on loopback or not at all (reachable: "
                               f"{sorted(reachable) or 'none'}); the kubelet probes the pod IP")


def main(paths):
    found = [line for path in paths for line in problems(path)]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
