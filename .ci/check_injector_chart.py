#!/usr/bin/env python3
"""Checks what schema validation cannot see in the rendered injector chart.

For each file (one `helm template` of helm/dedupd-injector):
- the MutatingWebhookConfiguration: pods on CREATE only, the objectSelector
  on dedupd.io/inject=enabled, sideEffects None, admissionReviewVersions v1,
  reinvocationPolicy IfNeeded, a failurePolicy, the release's namespace and
  kube-system excluded, /mutate on the chart's Service;
- TLS, either generated (a kubernetes.io/tls Secret whose certificate names
  the Service and is signed by the webhook's caBundle, checked with openssl)
  or from cert-manager (inject-ca-from naming a Certificate for the Service
  whose secretName the Deployment mounts, and an issuer);
- the Deployment (>= 2 replicas, the TLS Secret mounted) and a
  PodDisruptionBudget selecting its pods.
cert-manager documents are then removed from the file (no schema for them
offline), so kubernetes-validate can check the rest.

    check_injector_chart.py FILE...     exit 1 with one line per problem
"""

import base64
import os
import subprocess
import sys
import tempfile

import yaml


def fail(path, message):
    print(f"{path}: {message}")
    return 1


def by_kind(documents, kind):
    return [d for d in documents if d.get("kind") == kind]


def check_generated_cert(path, secret, ca_bundle, dns_names):
    problems = 0
    with tempfile.TemporaryDirectory() as work:
        files = {}
        for name, data in (("ca.crt", ca_bundle), ("tls.crt", secret["data"]["tls.crt"])):
            files[name] = os.path.join(work, name)
            with open(files[name], "wb") as out:
                out.write(base64.b64decode(data))
        verified = subprocess.run(["openssl", "verify", "-CAfile", files["ca.crt"], files["tls.crt"]],
                                  capture_output=True, text=True)
        if verified.returncode != 0:
            problems += fail(path, f"the serving certificate is not signed by the caBundle: {verified.stdout}{verified.stderr}")
        san = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", files["tls.crt"]],
                             capture_output=True, text=True, check=True).stdout
        for name in dns_names:
            if f"DNS:{name}" not in san:
                problems += fail(path, f"the serving certificate does not name {name}: {san.strip()}")
    return problems


def check(path):
    with open(path, encoding="utf-8") as rendered:
        documents = [d for d in yaml.safe_load_all(rendered) if d]
    problems = 0
    webhooks = by_kind(documents, "MutatingWebhookConfiguration")
    deployments = by_kind(documents, "Deployment")
    services = by_kind(documents, "Service")
    if len(webhooks) != 1 or len(deployments) != 1 or len(services) != 1:
        return fail(path, "expected one MutatingWebhookConfiguration, Deployment and Service")
    configuration, deployment, service = webhooks[0], deployments[0], services[0]
    namespace = service["metadata"].get("namespace") or "dedupd-system"
    hook = configuration["webhooks"][0]
    expected = {
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "reinvocationPolicy": "IfNeeded",
    }
    for key, value in expected.items():
        if hook.get(key) != value:
            problems += fail(path, f"webhook {key} is {hook.get(key)!r}, expected {value!r}")
    if hook.get("failurePolicy") not in ("Fail", "Ignore"):
        problems += fail(path, "webhook failurePolicy missing")
    rules = hook.get("rules") or []
    if rules != [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                  "resources": ["pods"], "scope": "Namespaced"}]:
        problems += fail(path, f"webhook rules are not pods on CREATE: {rules}")
    if (hook.get("objectSelector") or {}).get("matchLabels") != {"dedupd.io/inject": "enabled"}:
        problems += fail(path, "the objectSelector does not select dedupd.io/inject=enabled")
    excluded = []
    for expression in (hook.get("namespaceSelector") or {}).get("matchExpressions") or []:
        if expression.get("key") == "kubernetes.io/metadata.name" and expression.get("operator") == "NotIn":
            excluded += expression.get("values") or []
    for must in ("kube-system", "dedupd-system"):
        if must not in excluded:
            problems += fail(path, f"namespace {must} is not excluded from the webhook")
    target = hook["clientConfig"].get("service") or {}
    if target.get("name") != service["metadata"]["name"] or target.get("path") != "/mutate":
        problems += fail(path, f"the webhook does not call /mutate on the chart's Service: {target}")

    svc = service["metadata"]["name"]
    dns_names = [f"{svc}.{namespace}.svc"]
    pod_spec = deployment["spec"]["template"]["spec"]
    mounted = [v["secret"]["secretName"] for v in pod_spec.get("volumes") or [] if "secret" in v]
    if deployment["spec"].get("replicas", 1) < 2:
        problems += fail(path, "the injector runs fewer than 2 replicas")
    budgets = by_kind(documents, "PodDisruptionBudget")
    selector = deployment["spec"]["selector"]["matchLabels"]
    if not any(b["spec"]["selector"].get("matchLabels") == selector for b in budgets):
        problems += fail(path, "no PodDisruptionBudget selects the injector's pods")

    annotations = configuration["metadata"].get("annotations") or {}
    certificates = by_kind(documents, "Certificate")
    if "cert-manager.io/inject-ca-from" in annotations:
        if "caBundle" in hook["clientConfig"]:
            problems += fail(path, "with cert-manager the caBundle must be left to its CA injector")
        ref = annotations["cert-manager.io/inject-ca-from"]
        matching = [c for c in certificates if f"{namespace}/{c['metadata']['name']}" == ref]
        if not matching:
            problems += fail(path, f"inject-ca-from {ref} names no Certificate in the chart")
        for certificate in matching:
            if certificate["spec"].get("secretName") not in mounted:
                problems += fail(path, "the Deployment does not mount the Certificate's Secret")
            for name in dns_names:
                if name not in certificate["spec"].get("dnsNames", []):
                    problems += fail(path, f"the Certificate does not name {name}")
            issuer = certificate["spec"].get("issuerRef") or {}
            local = [i for i in by_kind(documents, "Issuer") if i["metadata"]["name"] == issuer.get("name")]
            if issuer.get("kind") == "Issuer" and not local:
                problems += fail(path, f"the Certificate's Issuer {issuer.get('name')} is not in the chart")
    else:
        secrets = [s for s in by_kind(documents, "Secret") if s["metadata"]["name"] in mounted]
        if len(secrets) != 1 or secrets[0].get("type") != "kubernetes.io/tls":
            return problems + fail(path, "no generated kubernetes.io/tls Secret mounted by the Deployment")
        if not hook["clientConfig"].get("caBundle"):
            return problems + fail(path, "the webhook has no caBundle")
        problems += check_generated_cert(path, secrets[0], hook["clientConfig"]["caBundle"], dns_names)

    kept = [d for d in documents if not str(d.get("apiVersion", "")).startswith("cert-manager.io/")]
    with open(path, "w", encoding="utf-8") as rewritten:
        yaml.safe_dump_all(kept, rewritten)
    return problems


def main(paths):
    problems = sum(check(path) for path in paths)
    if problems == 0:
        print(f"injector chart: webhook, TLS and availability checked in {len(paths)} renderings")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
