#!/usr/bin/env python3
"""Offline checks of the deployment kit in deploy/ that promtool and systemd-analyze cannot make.

Run by scripts/check-deploy.sh; prints one line per check and exits 1 on any failure.

- Kubernetes (deploy/kubernetes): every YAML document parses and has apiVersion, kind and
  metadata.name; the Deployment's probes point at paths the relay serves (/healthz for liveness,
  /readyz for readiness), its container port is the relay's default http.listen port and the one the
  ConfigMap's relay.toml listens on; the Secret, ConfigMap, Service and PodMonitor it refers to or
  that select it exist and match; the securityContext is the non-root, read-only one the docs
  promise. With kubernetes-validate installed (PyPI, schemas bundled: no network), the built-in
  kinds are also validated against the Kubernetes API schema, strictly (unknown fields fail).
- Alerts (deploy/prometheus): every rule has a summary, a description and a runbook_url whose anchor
  is a heading of docs/operations.md; alerts_test.yml has a case where each alert fires and one
  where it stays silent (promtool passes a test file that forgets an alert).
- Dashboard (deploy/grafana): every query is valid PromQL (promtool checks them as recording rules,
  with Grafana's variables replaced), and docs/operations.md describes every panel.

Whether the metric names in the alerts and the dashboard exist is checked against a live relay by
tests/integration/deploy.rs, and whether the settings the manifests use exist by the relay's own config
loader.

PyYAML: Debian's python3-yaml, or PyPI's PyYAML (kubernetes-validate depends on it).
"""

import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
OPERATIONS = ROOT / "docs" / "operations.md"
# The relay's HTTP paths (src/http.rs) and its default port (http.listen = "127.0.0.1:9187").
LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"
DEFAULT_PORT = 9187
# The job name the alert rules select (`up{job="outbox-relay"}`).
ALERT_JOB = "outbox-relay"
# PodMonitor fields of the Prometheus operator's monitoring.coreos.com/v1 API that this kit may use;
# kubernetes-validate has no schema for the CRD, so a misspelt field would otherwise pass unnoticed.
PODMONITOR_SPEC_FIELDS = {
    "jobLabel", "podTargetLabels", "podMetricsEndpoints", "selector", "namespaceSelector",
    "sampleLimit", "targetLimit", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit",
    "attachMetadata", "scrapeProtocols", "scrapeClass", "bodySizeLimit",
    "keepDroppedTargets",
}
PODMONITOR_ENDPOINT_FIELDS = {
    "port", "portNumber", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout",
    "honorLabels", "honorTimestamps", "relabelings", "metricRelabelings", "tlsConfig",
    "basicAuth", "bearerTokenSecret", "authorization", "oauth2", "followRedirects",
    "enableHttp2", "filterRunning", "proxyUrl", "trackTimestampsStaleness",
}

failures = []


def check(ok, what):
    print(("ok:   " if ok else "FAIL: ") + what)
    if not ok:
        failures.append(what)
    return ok


def github_anchor(heading):
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def doc_anchors(path):
    anchors = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(github_anchor(line.lstrip("#")))
    return anchors


# --- Kubernetes ------------------------------------------------------------------------------------

def load_k8s():
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def port_of(container, ref):
    """A probe's or Service's port (a name or a number) as the container's port number."""
    if isinstance(ref, int):
        return ref
    for p in container.get("ports", []):
        if p.get("name") == ref:
            return p["containerPort"]
    return None


def check_kubernetes():
    docs = load_k8s()
    check(docs, f"{K8S.relative_to(ROOT)}: YAML documents found")
    by_kind = {}
    for name, doc in docs:
        ok = (isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind")
              and doc.get("metadata", {}).get("name"))
        check(ok, f"{name}: apiVersion, kind and metadata.name are set")
        if ok:
            by_kind.setdefault(doc["kind"], []).append(doc)
    for kind in ("ConfigMap", "Secret", "Deployment", "Service", "PodMonitor"):
        check(len(by_kind.get(kind, [])) == 1, f"exactly one {kind}")
    if failures:
        return
    deployment = by_kind["Deployment"][0]
    configmap = by_kind["ConfigMap"][0]
    secret = by_kind["Secret"][0]
    service = by_kind["Service"][0]
    podmonitor = by_kind["PodMonitor"][0]
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    containers = pod["containers"]
    check(len(containers) == 1, "Deployment: one container")
    c = containers[0]

    check(spec.get("replicas") == 1, "Deployment: replicas 1 (one active relay per slot)")
    check(spec.get("strategy", {}).get("type") == "Recreate", "Deployment: strategy Recreate")
    check(pod.get("enableServiceLinks") is False, "Deployment: enableServiceLinks false")
    selector = spec["selector"]["matchLabels"]
    check(selector.items() <= pod_labels.items(), "Deployment: selector matches the pod labels")

    live = c.get("livenessProbe", {}).get("httpGet", {})
    ready = c.get("readinessProbe", {}).get("httpGet", {})
    check(live.get("path") == LIVENESS_PATH, f"liveness probe: {LIVENESS_PATH}")
    check(ready.get("path") == READINESS_PATH, f"readiness probe: {READINESS_PATH}")
    port = port_of(c, "http")
    check(port == DEFAULT_PORT, f"container port http is {DEFAULT_PORT}, the default http.listen port")
    check(port_of(c, live.get("port")) == port and port_of(c, ready.get("port")) == port,
          "probes use the http port")

    # The relay listens where the probes knock: the ConfigMap's relay.toml, mounted as --config.
    args = c.get("args", [])
    config_path = args[args.index("--config") + 1] if "--config" in args else None
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mount_dir = str(Path(config_path).parent) if config_path else None
    volume = volumes.get(mounts.get(mount_dir, ""), {})
    check(volume.get("configMap", {}).get("name") == configmap["metadata"]["name"],
          f"--config {config_path} is in the mounted ConfigMap")
    key = Path(config_path).name if config_path else ""
    check(key in configmap.get("data", {}), f"ConfigMap has {key}")
    relay_toml = tomllib.loads(configmap["data"].get(key, ""))
    listen = relay_toml.get("http", {}).get("listen", "")
    check(listen.startswith("0.0.0.0:") and listen.rsplit(":", 1)[1] == str(port),
          f"relay.toml http.listen {listen!r} is reachable from outside the pod on {port}")

    for e in c.get("env", []):
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            check(ref["name"] == secret["metadata"]["name"]
                  and ref["key"] in secret.get("stringData", secret.get("data", {})),
                  f"env {e['name']}: Secret {ref['name']} has key {ref['key']}")

    psc = pod.get("securityContext", {})
    csc = c.get("securityContext", {})
    check(psc.get("runAsNonRoot") is True and isinstance(psc.get("runAsUser"), int)
          and psc["runAsUser"] > 0, "pod runs as a numeric non-root user")
    check(csc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem")
    check(csc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation false")
    check(csc.get("capabilities", {}).get("drop") == ["ALL"], "capabilities: drop ALL")
    res = c.get("resources", {})
    check(res.get("requests", {}).get("memory") and res.get("limits", {}).get("memory"),
          "memory request and limit set")

    svc = service["spec"]
    check(svc["selector"].items() <= pod_labels.items(), "Service selects the relay pods")
    check(all(port_of(c, p.get("targetPort")) == port for p in svc["ports"]),
          "Service targets the http port")
    check(svc.get("publishNotReadyAddresses") is True,
          "Service publishes not-ready addresses (a standby's metrics)")

    pm = podmonitor["spec"]
    check(set(pm) <= PODMONITOR_SPEC_FIELDS, f"PodMonitor spec fields are known: {sorted(pm)}")
    check(pm["selector"]["matchLabels"].items() <= pod_labels.items(),
          "PodMonitor selects the relay pods")
    for ep in pm["podMetricsEndpoints"]:
        check(set(ep) <= PODMONITOR_ENDPOINT_FIELDS, f"PodMonitor endpoint fields are known: {sorted(ep)}")
        check(port_of(c, ep.get("port")) == port and ep.get("path", "/metrics") == "/metrics",
              "PodMonitor scrapes /metrics on the http port")
    check(pod_labels.get(pm.get("jobLabel")) == ALERT_JOB,
          f"PodMonitor's job label is {ALERT_JOB!r}, the job the alert rules select")

    # The optional standby: a strategic-merge patch of the same Deployment, in a folder of its own so
    # that `kubectl apply -f deploy/kubernetes/` does not apply it as a manifest.
    patch = yaml.safe_load((K8S / "standby/deployment-patch.yaml").read_text())
    check(patch["kind"] == "Deployment" and patch["metadata"]["name"] == deployment["metadata"]["name"],
          "standby/deployment-patch.yaml patches the Deployment")
    pspec = patch["spec"]
    check(pspec["replicas"] == 2, "standby patch: 2 replicas")
    rolling = pspec["strategy"].get("rollingUpdate", {})
    check(pspec["strategy"]["type"] == "RollingUpdate" and rolling.get("maxSurge") == 0,
          "standby patch: rolling update without surge (never a third relay)")
    pc = pspec["template"]["spec"]["containers"][0]
    check(pc["name"] == c["name"], "standby patch: container name matches")
    check(pc["readinessProbe"]["httpGet"]["path"] == LIVENESS_PATH,
          "standby patch: readiness is /healthz (one of two replicas is never /readyz-ready)")
    check(pspec["template"]["metadata"]["labels"].get("relay_ha") == "expected"
          and "relay_ha" in pm.get("podTargetLabels", []),
          "standby patch: relay_ha=expected reaches the metrics (OutboxRelayNoStandby)")

    validator = shutil.which("kubernetes-validate")
    if validator:
        files = [str(K8S / n) for n in sorted({n for n, d in docs if d.get("kind") != "PodMonitor"})]
        r = subprocess.run([validator, "--strict", "--quiet", *files], capture_output=True, text=True)
        out = (r.stdout + r.stderr).strip()
        check(r.returncode == 0 and "ERROR" not in out,
              "kubernetes-validate --strict (Kubernetes API schema)" + (f":\n{out}" if out else ""))
    else:
        print("skip: kubernetes-validate not installed (pip install kubernetes-validate); "
              "schema validation not done")


# --- Alerts ----------------------------------------------------------------------------------------

def check_alerts():
    rules_file = DEPLOY / "prometheus" / "alerts.yml"
    tests_file = DEPLOY / "prometheus" / "alerts_test.yml"
    anchors = doc_anchors(OPERATIONS)
    alerts = [r for g in yaml.safe_load(rules_file.read_text())["groups"] for r in g["rules"]
              if "alert" in r]
    check(alerts, "alerts.yml has alerts")
    for r in alerts:
        a = r.get("annotations", {})
        name = r["alert"]
        check(a.get("summary") and a.get("description"), f"{name}: summary and description")
        check(r.get("labels", {}).get("severity") in ("critical", "warning"), f"{name}: severity")
        url = a.get("runbook_url", "")
        page, _, anchor = url.partition("#")
        check(page == "docs/operations.md" and anchor in anchors,
              f"{name}: runbook_url {url!r} is a heading of docs/operations.md")
    fires, silent = set(), set()
    for group in yaml.safe_load(tests_file.read_text())["tests"]:
        for t in group.get("alert_rule_test", []):
            (fires if t.get("exp_alerts") else silent).add(t["alertname"])
    for r in alerts:
        check(r["alert"] in fires, f"{r['alert']}: a test case where it fires")
        check(r["alert"] in silent, f"{r['alert']}: a test case where it stays silent")


# --- Dashboard -------------------------------------------------------------------------------------

def queries(node):
    """Every PromQL string of a dashboard: panel targets' expr and the variables' queries."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "expr" and isinstance(v, str):
                yield v
            elif k == "query" and isinstance(v, str) and "(" in v:
                yield v
            else:
                yield from queries(v)
    elif isinstance(node, list):
        for v in node:
            yield from queries(v)


def check_dashboard():
    path = DEPLOY / "grafana" / "outbox-relay.json"
    dash = json.loads(path.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    check(panels, "dashboard has panels")
    ops = OPERATIONS.read_text()
    for p in panels:
        check(p.get("title") and p.get("description") and p.get("targets"),
              f"panel {p.get('title')!r}: title, description and queries")
        check(f"**{p['title']}**" in ops, f"panel {p['title']!r} is described in docs/operations.md")
    promtool = shutil.which("promtool")
    if not promtool:
        print("skip: promtool not installed; dashboard queries not parsed")
        return
    # label_values() is Grafana's, not PromQL: check its selector argument instead.
    exprs = []
    for q in queries(dash):
        m = re.fullmatch(r"label_values\((.*),\s*\w+\)", q)
        exprs.append(m.group(1) if m else q)
    rules = []
    for i, e in enumerate(exprs):
        e = (e.replace("$__rate_interval", "1m").replace("$__range", "1h")
             .replace("$job", "x").replace("$instance", "x"))
        rules.append({"record": f"dashboard:query_{i}", "expr": e})
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
    r = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
    Path(f.name).unlink()
    check(r.returncode == 0, f"{len(exprs)} dashboard queries are valid PromQL"
          + ("" if r.returncode == 0 else ":\n" + r.stdout + r.stderr))


check_kubernetes()
check_alerts()
check_dashboard()
if failures:
    print(f"\n{len(failures)} deployment check(s) failed", file=sys.stderr)
    sys.exit(1)
print("deployment checks passed")
