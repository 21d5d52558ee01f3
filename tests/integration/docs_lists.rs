//! The docs' lists of what the repository has, compared with the repository: every command
//! `outbox-relay --help` prints is in docs/configuration.md's "All N commands (…)" line and in
//! docs/compatibility.md's stable commands, every file in sql/ is in docs/README.md's SQL index,
//! and every file of tests/integration/ and tests/simulation/ is in CONTRIBUTING.md's table of
//! where a change's test goes, so a new command, SQL file or test module that the docs leave out
//! fails here. The other way round, every `src/`, `tests/`, `benches/` or `examples/` path that a
//! doc, a comment, a script or CI names exists, so a file moved without its citations fails here.

use std::time::Duration;

use crate::support::run_command;

/// The commands `outbox-relay --help` lists, without `help`.
fn commands_of_the_binary() -> Vec<String> {
    let help = run_command(&["--help"], &[], Duration::from_secs(30));
    assert!(help.status.success(), "{}", help.stderr);
    let (_, list) = help
        .stdout
        .split_once("Commands:\n")
        .unwrap_or_else(|| panic!("--help lists commands:\n{}", help.stdout));
    let mut commands: Vec<String> = list
        .lines()
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect();
    commands.sort();
    commands
}

/// The backquoted words in the parentheses after `marker` in `doc`.
fn listed(doc: &str, marker: &str) -> Vec<String> {
    let path = format!("{}/docs/{doc}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let (_, rest) = text
        .split_once(marker)
        .unwrap_or_else(|| panic!("{doc} has {marker:?}"));
    let (_, rest) = rest.split_once('(').expect("a list in parentheses");
    let (inside, _) = rest.split_once(')').expect("the list ends");
    let mut words: Vec<String> = inside
        .split(',')
        .map(|w| w.trim().trim_matches('`').to_owned())
        .filter(|w| !w.starts_with('-'))
        .collect();
    words.sort();
    words
}

#[test]
fn the_docs_name_every_command_of_the_binary() {
    let commands = commands_of_the_binary();
    assert_eq!(commands.len(), 8, "{commands:?}");
    // "- All eight commands (`run`, …)": the list, and the number in words.
    assert_eq!(
        listed("configuration.md", "- All "),
        commands,
        "docs/configuration.md"
    );
    let config = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .unwrap();
    assert!(
        config.contains("- All eight commands ("),
        "docs/configuration.md counts the commands"
    );
    assert_eq!(
        listed("compatibility.md", "| **Commands and exit codes**"),
        commands,
        "docs/compatibility.md"
    );
}

#[test]
fn the_sql_index_names_every_sql_file() {
    let root = env!("CARGO_MANIFEST_DIR");
    let index = std::fs::read_to_string(format!("{root}/docs/README.md")).unwrap();
    let mut files: Vec<String> = std::fs::read_dir(format!("{root}/sql"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".sql"))
        .collect();
    files.sort();
    assert!(files.len() >= 9, "{files:?}");
    let missing: Vec<&String> = files
        .iter()
        .filter(|f| !index.contains(&format!("| `{f}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/README.md's SQL index leaves out {missing:?}"
    );
}

/// The `.rs` files under `dir`, as paths relative to `root` with `/` separators.
fn rust_files(root: &std::path::Path, dir: &std::path::Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(root).unwrap();
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
}

#[test]
fn contributings_table_names_every_test_module() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("CONTRIBUTING.md")).unwrap();
    let (_, table) = text
        .split_once("### Where a change's test goes")
        .expect("CONTRIBUTING.md has the table of where a change's test goes");
    let table = table.split("\n## ").next().unwrap();
    let tests = root.join("tests");
    let mut files = Vec::new();
    rust_files(&tests, &tests.join("integration"), &mut files);
    rust_files(&tests, &tests.join("simulation"), &mut files);
    files.sort();
    assert!(files.len() >= 50, "{files:?}");
    let missing: Vec<&String> = files
        .iter()
        .filter(|f| !table.contains(&format!("`{f}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "CONTRIBUTING.md's table of where a change's test goes leaves out {missing:?}"
    );
}

/// The repository paths `text` names: every `src/…`, `tests/…`, `benches/…` or `examples/…` that
/// starts a word (so Postgres' own `postgres/src/…` is not one) and ends in `.rs`, or, when `dirs`,
/// in `/`.
fn cited_paths(text: &str, dirs: bool) -> Vec<String> {
    let in_path = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    let mut paths = Vec::new();
    for prefix in ["src/", "tests/", "benches/", "examples/"] {
        for (at, _) in text.match_indices(prefix) {
            if text[..at].chars().next_back().is_some_and(in_path) {
                continue;
            }
            let end = text[at..]
                .find(|c| !in_path(c))
                .map_or(text.len(), |n| at + n);
            let path = text[at..end].trim_end_matches('.');
            if path.ends_with(".rs") || (dirs && path.ends_with('/')) {
                paths.push(path.to_owned());
            }
        }
    }
    paths
}

/// The text files of the repository whose citations are checked, relative to `root`: the docs, the
/// code and its comments, the scripts, CI and the deploy files. Not CHANGELOG.md, whose entries name
/// files as they were then.
fn files_that_cite(root: &std::path::Path, dir: &std::path::Path, out: &mut Vec<String>) {
    const SKIP: [&str; 5] = ["target", ".git", "corpus", "artifacts", "CHANGELOG.md"];
    const TEXT: [&str; 8] = ["md", "rs", "toml", "sh", "py", "yml", "yaml", "run"];
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if SKIP.contains(&&*name) || (name.starts_with('.') && name != ".ci") {
            continue;
        }
        if path.is_dir() {
            files_that_cite(root, &path, out);
        } else if TEXT
            .iter()
            .any(|e| name.ends_with(&format!(".{e}")) || name == *e)
        {
            let rel = path.strip_prefix(root).unwrap();
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
}

#[test]
fn every_path_the_docs_and_comments_cite_exists() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    files_that_cite(root, root, &mut files);
    files.sort();
    assert!(
        files.contains(&"docs/architecture.md".to_owned())
            && files.contains(&"CONTRIBUTING.md".to_owned())
            && files.contains(&"src/main.rs".to_owned()),
        "{files:?}"
    );
    let mut stale = Vec::new();
    let mut cited = 0;
    for file in &files {
        let Ok(text) = std::fs::read_to_string(root.join(file)) else {
            continue;
        };
        // A directory is checked in the docs only: the code's comments cite Postgres' source tree
        // (`src/backend/…`) as well as this one's.
        let markdown = file.ends_with(".md");
        let mut paths = cited_paths(&text, markdown);
        if file == "CONTRIBUTING.md" {
            // Its table of where a change's test goes names test files relative to `tests/`.
            for prefix in ["`integration/", "`simulation/"] {
                for (at, _) in text.match_indices(prefix) {
                    let rest = &text[at + 1..];
                    let path = &rest[..rest.find('`').unwrap_or(rest.len())];
                    paths.push(format!("tests/{path}"));
                }
            }
        }
        for path in paths {
            cited += 1;
            if !root.join(&path).exists() {
                stale.push(format!("{file} cites {path}"));
            }
        }
    }
    assert!(
        cited >= 100,
        "only {cited} citations found: the scan is broken"
    );
    assert!(
        stale.is_empty(),
        "paths that no longer exist (find where the code went and cite that):\n{}",
        stale.join("\n")
    );
}

/// The rows of docs/operations.md's metrics table: each metric's name, type and labels cell.
fn metrics_table() -> Vec<(String, String, String)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let (_, section) = text
        .split_once("\n## Metrics\n")
        .expect("docs/operations.md has a Metrics section");
    let section = section.split("\n## ").next().unwrap();
    section
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split(" | ").collect();
            let name = cells.first()?.strip_prefix("| `")?.strip_suffix('`')?;
            Some((
                name.to_owned(),
                cells.get(1)?.to_string(),
                cells.get(2)?.to_string(),
            ))
        })
        .collect()
}

/// Labels whose values are the application's own (event types), so the table names the label only.
const OPEN_LABELS: [&str; 2] = ["le", "event_type"];

/// docs/operations.md's metrics table against a running relay's `/metrics`: every family it serves
/// has a row with its type, every label it carries is in the row's labels cell with every value
/// (except open ones), and no row names a family the relay does not serve.
#[tokio::test]
async fn the_metrics_table_names_every_series_a_running_relay_serves() {
    let exposition = crate::deploy::parse_exposition(&crate::deploy::live_metrics().await);
    let table = metrics_table();
    assert!(table.len() >= 15, "the table scan is broken: {table:?}");
    let mut errors = Vec::new();
    for (family, kind) in &exposition.types {
        let Some((_, doc_kind, labels)) = table.iter().find(|(n, ..)| n == family) else {
            errors.push(format!("{family} ({kind}): no row"));
            continue;
        };
        if doc_kind != kind {
            errors.push(format!(
                "{family}: the row says {doc_kind}, /metrics {kind}"
            ));
        }
        let served = exposition
            .samples
            .iter()
            .filter(|(name, _)| crate::deploy::family_of(&exposition, name) == Some(family))
            .flat_map(|(_, labels)| labels);
        for (label, values) in served {
            if !labels.contains(&format!("`{label}`")) && !labels.contains(&format!("`{label}=")) {
                errors.push(format!("{family}: label {label} is not in the row"));
                continue;
            }
            if OPEN_LABELS.contains(&label.as_str()) {
                continue;
            }
            for v in values {
                if !labels.contains(&format!("\"{v}\"")) && !labels.contains(&format!("`{v}`")) {
                    errors.push(format!("{family}: {label}={v:?} is not in the row"));
                }
            }
        }
    }
    for (name, ..) in &table {
        if !exposition.types.contains_key(name) {
            errors.push(format!("{name}: a row, but /metrics does not serve it"));
        }
    }
    assert!(
        errors.is_empty(),
        "docs/operations.md's metrics table and a running relay's /metrics disagree:\n{}",
        errors.join("\n")
    );
}

/// `text` with comment markers and line breaks gone: one line of single-spaced words.
fn prose(text: &str) -> String {
    text.lines()
        .map(|l| l.trim().trim_start_matches('#').trim())
        .collect::<Vec<_>>()
        .join(" ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The Kubernetes ConfigMap, the systemd unit, docs/operations.md and every other file of the
/// deployment kit that says what SIGHUP applies name the keys it applies (`reload::RELOADED_KEYS`, which the SIGHUP table in
/// docs/configuration.md is held to), all of them and in one list: "a, b and c".
#[test]
fn every_file_that_explains_sighup_lists_the_keys_it_applies() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let keys = outbox_relay::reload::RELOADED_KEYS;
    assert!(keys.len() >= 2, "{keys:?}");
    let list = |quote: &str| {
        let q: Vec<String> = keys.iter().map(|k| format!("{quote}{k}{quote}")).collect();
        format!("{} and {}", q[..q.len() - 1].join(", "), q[q.len() - 1])
    };
    let (plain, quoted) = (list(""), list("`"));
    // The places an operator changing the configuration reads, whatever they say today.
    let mut files: Vec<_> = [
        "docs/operations.md",
        "deploy/kubernetes/configmap.yaml",
        "deploy/systemd/outbox-relay.service",
    ]
    .iter()
    .map(|f| root.join(f))
    .collect();
    let mut dirs = vec![root.join("deploy")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if !files.contains(&path)
                && std::fs::read_to_string(&path)
                    .is_ok_and(|t| t.contains("SIGHUP") && t.contains("applied"))
            {
                files.push(path);
            }
        }
    }
    assert!(files.len() >= 3, "{files:?}");
    let stale: Vec<String> = files
        .iter()
        .filter(|f| {
            let text = prose(&std::fs::read_to_string(f).unwrap());
            !text.contains(&plain) && !text.contains(&quoted)
        })
        .map(|f| f.strip_prefix(root).unwrap().display().to_string())
        .collect();
    assert!(
        stale.is_empty(),
        "these explain SIGHUP without the list of keys it applies ({plain}): {stale:?}"
    );
}

/// Each command's `--help` says what it does in one sentence: one paragraph with no second sentence
/// inside it (clap drops the summary's final full stop).
#[test]
fn each_commands_help_is_one_sentence() {
    for command in commands_of_the_binary() {
        let help = run_command(&[&command, "--help"], &[], Duration::from_secs(30));
        assert!(help.status.success(), "{command} --help: {}", help.stderr);
        let (about, _) = help
            .stdout
            .split_once("\n\nUsage:")
            .unwrap_or_else(|| panic!("{command} --help:\n{}", help.stdout));
        let about = about.trim();
        let sentence = about.replace('\n', " ");
        let second = sentence.char_indices().any(|(i, c)| {
            c == '.' && sentence[i + 1..].starts_with(' ') && {
                sentence[i + 1..]
                    .trim_start()
                    .starts_with(|c: char| c.is_uppercase())
            }
        });
        assert!(
            !about.is_empty() && !about.contains("\n\n") && !second,
            "`outbox-relay {command} --help` is not one sentence:\n{about}"
        );
    }
}
