//! The deployment kit in `deploy/` against the relay itself: every `outbox_relay_*` series that the
//! alert rules, their promtool tests and the Grafana dashboard name exists in a live relay's
//! `/metrics`, with the labels and label values they select; every `OUTBOX_RELAY_*` variable the
//! manifests, the systemd files and docker-compose.yml set is a real setting, and the shipped
//! `relay.toml` files load with the relay's own config loader. A renamed metric, label or setting
//! fails here instead of in an operator's silent alert or empty panel.
//!
//! The files are read as text (the dashboard as JSON): metric names are found as identifiers that
//! start with `outbox_relay_`, wherever they stand. Structure (YAML documents, probes, alert
//! annotations) is checked by `scripts/check_deploy.py`, which runs without a build.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use outbox_relay::config::Config;
use serde_json::Value;

use crate::ops::{free_addr, scrape, wait_for_status};
use crate::support::{
    NatsServer, PgServer, RelayProcess, TestDb, default_outbox_sql, relay_config, relay_env,
};

const PREFIX: &str = "outbox_relay_";

/// Labels that Prometheus adds to a target (and this kit's target labels, see
/// deploy/prometheus/alerts.yml): a selector may use them although no relay exports them.
const TARGET_LABELS: [&str; 9] = [
    "job",
    "instance",
    "namespace",
    "pod",
    "container",
    "service",
    "endpoint",
    "relay",
    "relay_ha",
];

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// What a scrape says exists: each family's type, and each sample name's labels with their values.
#[derive(Debug, Default)]
pub(crate) struct Exposition {
    pub(crate) types: BTreeMap<String, String>,
    pub(crate) samples: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
}

pub(crate) fn parse_exposition(text: &str) -> Exposition {
    let mut e = Exposition::default();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            e.types.insert(name.to_owned(), kind.to_owned());
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let name: String = line.chars().take_while(|&c| is_ident(c)).collect();
        let labels = e.samples.entry(name.clone()).or_default();
        if line[name.len()..].starts_with('{') {
            let matchers = parse_matchers(&line[name.len()..])
                .unwrap_or_else(|err| panic!("exposition line {line:?}: {err}"));
            for m in matchers {
                labels.entry(m.label).or_default().insert(m.value);
            }
        }
    }
    e
}

/// One `label op "value"` of a selector.
#[derive(Debug)]
struct Matcher {
    label: String,
    op: &'static str,
    value: String,
}

/// `{a="x", b=~"y|z"}` at the start of `s`: its matchers (the rest of `s` is not looked at).
fn parse_matchers(s: &str) -> Result<Vec<Matcher>, String> {
    let b = s.as_bytes();
    let mut i = 1;
    let mut out = Vec::new();
    let skip_ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    loop {
        skip_ws(&mut i);
        if i >= b.len() {
            return Err("selector does not end with }".into());
        }
        if b[i] == b'}' {
            return Ok(out);
        }
        let start = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        let label = s[start..i].to_owned();
        if label.is_empty() {
            return Err(format!("expected a label name at {:?}", &s[start..]));
        }
        skip_ws(&mut i);
        let op = ["=~", "!~", "!=", "="]
            .into_iter()
            .find(|op| s[i..].starts_with(op))
            .ok_or_else(|| format!("expected a matcher after {label}"))?;
        i += op.len();
        skip_ws(&mut i);
        if i >= b.len() || b[i] != b'"' {
            return Err(format!("expected a quoted value for {label}"));
        }
        i += 1;
        let mut value = String::new();
        loop {
            match b.get(i) {
                None => return Err(format!("unterminated value for {label}")),
                Some(b'\\') => {
                    value.push(*b.get(i + 1).ok_or("dangling backslash")? as char);
                    i += 2;
                }
                Some(b'"') => {
                    i += 1;
                    break;
                }
                Some(_) => {
                    let c = s[i..].chars().next().expect("a char");
                    value.push(c);
                    i += c.len_utf8();
                }
            }
        }
        out.push(Matcher { label, op, value });
        skip_ws(&mut i);
        if b.get(i) == Some(&b',') {
            i += 1;
        }
    }
}

/// One use of a metric in a file: the series name and the selector's matchers.
#[derive(Debug)]
struct Reference {
    source: String,
    name: String,
    matchers: Result<Vec<Matcher>, String>,
}

/// Every identifier starting with `outbox_relay_` in `text` (not inside a longer identifier), with
/// the matchers of a `{...}` right after it.
fn references(text: &str, source: &str) -> Vec<Reference> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(pos) = text[from..].find(PREFIX) {
        let start = from + pos;
        let preceded = text[..start].chars().next_back().is_some_and(is_ident);
        let name: String = text[start..].chars().take_while(|&c| is_ident(c)).collect();
        from = start + name.len();
        if preceded {
            continue;
        }
        let matchers = if text[from..].starts_with('{') {
            parse_matchers(&text[from..])
        } else {
            Ok(Vec::new())
        };
        out.push(Reference {
            source: source.to_owned(),
            name,
            matchers,
        });
    }
    out
}

/// The family a series name belongs to: itself, or for `_bucket`, `_sum` and `_count` the
/// histogram (or summary) it is part of. A gauge named `x` has no `x_count`.
pub(crate) fn family_of<'a>(e: &Exposition, name: &'a str) -> Option<&'a str> {
    if e.types.contains_key(name) {
        return Some(name);
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
        let base = name.strip_suffix(suffix)?;
        let kind = e.types.get(base)?;
        let ok = kind == "histogram" || (kind == "summary" && *suffix != "_bucket");
        ok.then_some(base)
    })
}

/// Whatever in `refs` the exposition does not have, one line each.
fn check_references(e: &Exposition, refs: &[Reference]) -> Vec<String> {
    let mut errors = Vec::new();
    for r in refs {
        let at = format!("{}: {}", r.source, r.name);
        let (Some(_), Some(labels)) = (family_of(e, &r.name), e.samples.get(&r.name)) else {
            errors.push(format!("{at}: no such series in /metrics"));
            continue;
        };
        let matchers = match &r.matchers {
            Ok(m) => m,
            Err(err) => {
                errors.push(format!("{at}: selector does not parse: {err}"));
                continue;
            }
        };
        for Matcher { label, op, value } in matchers {
            let Some(values) = labels.get(label) else {
                if !TARGET_LABELS.contains(&label.as_str()) {
                    errors.push(format!("{at}: no label {label} (has {:?})", labels.keys()));
                }
                continue;
            };
            // Only what a positive matcher names must exist; a regex is checked when it is a plain
            // list of alternatives.
            let wanted: Vec<&str> = match *op {
                "=" => vec![value.as_str()],
                "=~" if value.chars().all(|c| is_ident(c) || c == '|' || c == '+') => {
                    value.split('|').collect()
                }
                _ => Vec::new(),
            };
            for w in wanted {
                if !values.contains(w) {
                    errors.push(format!(
                        "{at}: {label}={w:?} never exported (has {values:?})"
                    ));
                }
            }
        }
    }
    errors
}

/// The dashboard's PromQL: every panel target's `expr` and every variable's query.
fn dashboard_queries(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "query" | "definition", Value::String(s)) => out.push(s.clone()),
                    _ => dashboard_queries(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| dashboard_queries(v, out)),
        _ => {}
    }
}

/// The references of each file in deploy/ that names metrics.
fn deploy_references() -> Vec<(&'static str, Vec<Reference>)> {
    const DASHBOARD: &str = "deploy/grafana/outbox-relay.json";
    let dashboard: Value = serde_json::from_str(&read(DASHBOARD)).expect("dashboard is JSON");
    let mut queries = Vec::new();
    dashboard_queries(&dashboard, &mut queries);
    let mut out = vec![(
        DASHBOARD,
        queries
            .iter()
            .flat_map(|q| references(q, DASHBOARD))
            .collect(),
    )];
    for file in [
        "deploy/prometheus/alerts.yml",
        "deploy/prometheus/alerts_test.yml",
    ] {
        // A quote escaped inside a double-quoted YAML string is still a quote of the selector.
        out.push((file, references(&read(file).replace("\\\"", "\""), file)));
    }
    out
}

/// `/metrics` of a relay started like the binary ships, with a JSON Schema that one event fails (so
/// the series labelled by event type has a sample), scraped once it counted that failure.
pub(crate) async fn live_metrics() -> String {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(&default_outbox_sql());
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let addr = free_addr();
    let schemas = tempfile::tempdir().expect("schema dir");
    fs::write(
        schemas.path().join("ClaimApproved.json"),
        r#"{"type": "object", "required": ["claim_id"]}"#,
    )
    .expect("write the schema");
    let mut env = relay_env(&config);
    env.retain(|(k, _)| k != "OUTBOX_RELAY_HTTP_LISTEN");
    env.push(("OUTBOX_RELAY_HTTP_LISTEN".into(), addr.clone()));
    let dir = schemas.path().display().to_string();
    env.push(("OUTBOX_RELAY_OUTBOX_SCHEMAS".into(), dir));
    let _relay = RelayProcess::spawn(&["run"], &env);
    wait_for_status(&addr, "/readyz", 200, 60).await;
    db.psql(
        "INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('Claim', '4711', 'ClaimApproved', '{}')",
    );
    let failed = "outbox_relay_schema_failures_total{event_type=\"ClaimApproved\"} 1";
    let mut text = scrape(&addr).await;
    for _ in 0..600 {
        if text.contains(failed) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        text = scrape(&addr).await;
    }
    assert!(text.contains(failed), "no schema failure counted:\n{text}");
    text
}

/// Every series that deploy/ uses is in a live relay's `/metrics`.
#[tokio::test]
async fn metrics_named_in_the_alerts_and_the_dashboard_exist_in_a_live_relay() {
    let exposition = parse_exposition(&live_metrics().await);

    let mut errors = Vec::new();
    let mut used = BTreeSet::new();
    for (file, refs) in deploy_references() {
        // A scanner that finds nothing would pass everything.
        assert!(
            refs.len() >= 8,
            "{file}: only {} metric references",
            refs.len()
        );
        used.extend(refs.iter().map(|r| r.name.clone()));
        errors.extend(check_references(&exposition, &refs));
    }
    assert!(
        errors.is_empty(),
        "deploy/ names series the relay does not export:\n{}",
        errors.join("\n")
    );
    assert!(
        used.contains("outbox_relay_commit_to_ack_seconds_bucket"),
        "the latency quantiles come from the histogram's buckets: {used:?}"
    );
}

/// The checker itself: it accepts a histogram's series and target labels, and rejects a renamed
/// metric, a bare histogram name, a suffix the family does not have, a renamed label or value.
#[test]
fn the_metric_cross_check_catches_renames() {
    let e = parse_exposition(
        "# TYPE outbox_relay_x_total counter\n\
         outbox_relay_x_total{outcome=\"ok\"} 1\n\
         outbox_relay_x_total{outcome=\"dead_letter\"} 0\n\
         # TYPE outbox_relay_h_seconds histogram\n\
         outbox_relay_h_seconds_bucket{le=\"1\"} 0\n\
         outbox_relay_h_seconds_bucket{le=\"+Inf\"} 0\n\
         outbox_relay_h_seconds_sum 0\n\
         outbox_relay_h_seconds_count 0\n\
         # TYPE outbox_relay_g gauge\n\
         outbox_relay_g 0\n",
    );
    let good = "rate(outbox_relay_x_total{outcome=\"ok\", job=~\"$job\"}[5m]) \
                + outbox_relay_x_total{outcome=~\"ok|dead_letter\"} \
                + histogram_quantile(0.9, sum by (le) (rate(outbox_relay_h_seconds_bucket{le!=\"1\"}[5m]))) \
                + outbox_relay_h_seconds_sum / outbox_relay_h_seconds_count + outbox_relay_g \
                + my_outbox_relay_g";
    let refs = references(good, "good");
    assert_eq!(refs.len(), 6, "{refs:?}");
    assert_eq!(check_references(&e, &refs), Vec::<String>::new());
    for bad in [
        "outbox_relay_x",
        "outbox_relay_h_seconds",
        "outbox_relay_g_count",
        "outbox_relay_g_bucket",
        "outbox_relay_x_total{result=\"ok\"}",
        "outbox_relay_x_total{outcome=\"okay\"}",
        "outbox_relay_x_total{outcome=~\"ok|lost\"}",
        "outbox_relay_x_total{outcome=\"ok\"",
    ] {
        let errors = check_references(&e, &references(bad, "bad"));
        assert!(!errors.is_empty(), "{bad} passed the cross-check");
    }
}

/// `OUTBOX_RELAY_<SECTION>_<KEY>` (or `OUTBOX_RELAY_<KEY>` at the top level) for every key the config
/// loader knows, derived the way it maps variables to keys (from the defaults).
fn setting_variables() -> BTreeSet<String> {
    let defaults = toml::Table::try_from(Config::default()).expect("defaults serialise");
    defaults
        .iter()
        .flat_map(|(section, keys)| match keys.as_table() {
            Some(keys) => keys
                .keys()
                .map(|key| format!("OUTBOX_RELAY_{section}_{key}").to_uppercase())
                .collect::<Vec<_>>(),
            // A top-level key (`name`): `OUTBOX_RELAY_<KEY>`.
            None => vec![format!("OUTBOX_RELAY_{section}").to_uppercase()],
        })
        .collect()
}

/// The ConfigMap's `relay.toml: |` block, without its indentation.
fn configmap_relay_toml() -> String {
    let text = read("deploy/kubernetes/configmap.yaml");
    let mut lines = text
        .lines()
        .skip_while(|l| l.trim() != "relay.toml: |")
        .skip(1);
    let first = lines.next().expect("relay.toml block in the ConfigMap");
    let indent = first.len() - first.trim_start().len();
    std::iter::once(first)
        .chain(lines.take_while(|l| l.trim().is_empty() || l.starts_with(&" ".repeat(indent))))
        .map(|l| l.get(indent..).unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

fn port(listen: &str) -> &str {
    listen.rsplit_once(':').map_or("", |(_, p)| p)
}

/// The variables the manifests, the systemd files and docker-compose.yml set are settings; the
/// shipped relay.toml files load; the container listens on the port the Deployment declares.
#[test]
fn settings_in_the_deploy_files_are_real_settings() {
    let known = setting_variables();
    assert!(known.contains("OUTBOX_RELAY_POSTGRES_URL"), "{known:?}");
    let files = [
        "deploy/kubernetes/configmap.yaml",
        "deploy/kubernetes/deployment.yaml",
        "deploy/kubernetes/secret.yaml",
        "deploy/kubernetes/verify-cronjob.yaml",
        "deploy/systemd/outbox-relay.service",
        "deploy/systemd/outbox-relay-verify.service",
        "deploy/systemd/outbox-relay.env.example",
        "docker-compose.yml",
    ];
    let mut used = BTreeSet::new();
    for file in files {
        // Comment lines may name variables on purpose (the ones Kubernetes injects, for one).
        for line in read(file)
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
        {
            let mut rest = line;
            while let Some(pos) = rest.find("OUTBOX_RELAY_") {
                let var: String = rest[pos..]
                    .chars()
                    .take_while(|&c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                    .collect();
                rest = &rest[pos + var.len()..];
                assert!(known.contains(&var), "{file}: {var} is not a setting");
                used.insert(var);
            }
        }
    }
    assert!(used.contains("OUTBOX_RELAY_POSTGRES_URL"), "{used:?}");

    let dir = tempfile::tempdir().expect("tempdir");
    let from_configmap = dir.path().join("relay.toml");
    fs::write(&from_configmap, configmap_relay_toml()).expect("write relay.toml");
    let in_pod = Config::load_with_env(Some(&from_configmap), Vec::new())
        .unwrap_or_else(|e| panic!("the ConfigMap's relay.toml: {e}"));
    Config::load_with_env(Some(&repo("deploy/systemd/relay.toml")), Vec::new())
        .unwrap_or_else(|e| panic!("deploy/systemd/relay.toml: {e}"));

    let default_port = port(&Config::default().http.listen).to_owned();
    assert_eq!(
        port(&in_pod.config().http.listen),
        default_port,
        "ConfigMap http.listen"
    );
    assert!(
        read("deploy/kubernetes/deployment.yaml")
            .contains(&format!("containerPort: {default_port}\n")),
        "the Deployment's containerPort is the default http.listen port {default_port}"
    );
}

/// The `kubectl apply` commands of the docs and of deploy/ (lines continued with `\` joined).
fn kubectl_applies(root: &Path) -> Vec<(String, String)> {
    let mut files = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs"), root.join("deploy")];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    let mut out = Vec::new();
    for file in files {
        let Ok(text) = fs::read_to_string(&file) else {
            continue;
        };
        let joined = text.replace("\\\n", " ");
        for line in joined.lines() {
            if let Some(at) = line.find("kubectl apply") {
                let name = file.strip_prefix(root).unwrap().display().to_string();
                out.push((name, line[at..].to_owned()));
            }
        }
    }
    out
}

/// Every `kubectl apply` the docs show names its manifests one by one, each of them a file of
/// deploy/kubernetes: never the folder (it holds the placeholder Secret, which would replace the real
/// one, and the PodMonitor, which needs the Prometheus operator's CRD), never secret.yaml, and the
/// PodMonitor only in a command of its own.
#[test]
fn kubectl_apply_in_the_docs_names_its_files_and_never_the_placeholder_secret() {
    let root = repo("");
    let applies = kubectl_applies(&root);
    assert!(applies.len() >= 3, "the scan is broken: {applies:?}");
    let mut errors = Vec::new();
    for (file, command) in &applies {
        let words: Vec<&str> = command
            .split(|c: char| c.is_whitespace() || c == '`')
            .filter(|w| !w.is_empty())
            .collect();
        let manifests: Vec<&str> = words
            .windows(2)
            .filter(|w| w[0] == "-f")
            .map(|w| w[1])
            .collect();
        if manifests.is_empty()
            || words
                .iter()
                .any(|w| *w == "-k" || w.starts_with("--filename"))
        {
            errors.push(format!("{file}: `{command}` names no manifest with -f"));
        }
        for m in &manifests {
            let name = m.strip_prefix("deploy/kubernetes/").unwrap_or(m);
            let exists =
                !name.ends_with('/') && root.join("deploy/kubernetes").join(name).is_file();
            if !exists || !(name.ends_with(".yaml") || name.ends_with(".yml")) {
                errors.push(format!(
                    "{file}: `{command}` applies {m}, not a manifest of deploy/kubernetes"
                ));
            } else if name == "secret.yaml" {
                errors.push(format!(
                    "{file}: `{command}` applies the placeholder Secret"
                ));
            } else if name == "podmonitor.yaml" && manifests.len() > 1 {
                errors.push(format!(
                    "{file}: `{command}` fails as a whole without the Prometheus operator's CRD"
                ));
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// Series the dashboard and the alerts leave out on purpose, with the reason. A series the relay
/// gains is on the dashboard, in an alert, or here.
const OFF_THE_DASHBOARD: [(&str, &str); 4] = [
    (
        "outbox_relay_schemas_loaded",
        "an echo of the schema directory, read when checking a reload; refused reloads are on the schema panel",
    ),
    (
        "outbox_relay_spans_exported_total",
        "tracing's own health, watched in the tracing backend; a span never holds back an event",
    ),
    (
        "outbox_relay_spans_dropped_total",
        "tracing's own health, watched in the tracing backend; a span never holds back an event",
    ),
    (
        "outbox_relay_position_requests_refused_total",
        "a client's misuse of the position service, looked for in NATS' connection list (security.md)",
    ),
];

/// Every family the metrics module renders is used by the dashboard or an alert rule, or listed in
/// [`OFF_THE_DASHBOARD`] with the reason; and nothing there is used after all.
#[test]
fn every_series_is_on_the_dashboard_or_in_an_alert_or_said_why_not() {
    let rendered = parse_exposition(&outbox_relay::metrics::Metrics::default().render());
    assert!(rendered.types.len() >= 20, "{:?}", rendered.types);
    let used: BTreeSet<String> = deploy_references()
        .into_iter()
        .flat_map(|(_, refs)| refs)
        .filter_map(|r| family_of(&rendered, &r.name).map(str::to_owned))
        .collect();
    let off: BTreeSet<&str> = OFF_THE_DASHBOARD.iter().map(|(n, _)| *n).collect();
    let unseen: Vec<&String> = rendered
        .types
        .keys()
        .filter(|f| !used.contains(*f) && !off.contains(f.as_str()))
        .collect();
    assert!(
        unseen.is_empty(),
        "neither the dashboard nor an alert shows {unseen:?}: add a panel (deploy/grafana/outbox-relay.json) \
         or say why not in OFF_THE_DASHBOARD"
    );
    let listed_but_used: Vec<&&str> = off.iter().filter(|f| used.contains(**f)).collect();
    assert!(
        listed_but_used.is_empty(),
        "OFF_THE_DASHBOARD lists series that deploy/ uses: {listed_but_used:?}"
    );
}
