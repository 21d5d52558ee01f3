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
    assert_eq!(commands.len(), 6, "{commands:?}");
    // "- All six commands (`run`, …)": the list, and the number in words.
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
        config.contains("- All six commands ("),
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
