//! The import graph between the library's top-level modules, read from the source: an edge A → B
//! for every `crate::B…` path in code (not comments) of a file under `src/A`. Cycles make a module
//! impossible to read without the others, so this test fails on any *new* one: every strongly
//! connected component of the graph must lie inside one of the components listed in [`KNOWN`],
//! which records the cycles the code has today. A change that breaks a cycle must shrink the list
//! (the test says which entry to change), so the list only ever gets shorter; the architecture
//! work's aim is an empty one.
//!
//! Read from the text rather than by a tool (cargo-modules) so that it runs with the rest of the
//! suite and needs nothing installed. `src/main.rs`, `src/lib.rs` are the roots, not modules. Being
//! textual, it also counts a `crate::` path inside a string literal: name the module differently there.
//!
//! Acyclic is not yet bottom-up: [`LAYERS`] declares the order the modules read in, and a second
//! test fails on any import from a lower layer to a higher one, and on a module with no layer.
//!
//! The same holds inside a folder: within every module that has child modules (`src/sink/`,
//! `src/sink/batch/`, …), the module's own file and its children must import each other without a
//! cycle ([`KNOWN_IN_FOLDERS`] records the ones left). A child names a sibling through
//! `super::sibling::…` or `crate::folder::sibling::…`; naming an item the folder's own file
//! re-exports (`super::Item`) is an edge to that file, which imports its children: a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The import cycles the library has today, as the sets of top-level modules in each strongly
/// connected component. Shrink an entry (or drop it) when a cycle is broken; never grow one.
const KNOWN: &[&[&str]] = &[];

/// The top-level modules in layers, bottom up. A module imports from its own layer and the layers
/// below it, never from one above (within a layer, the cycle test keeps the imports acyclic).
/// Every module has a place here: a new one takes the lowest layer whose modules cover what it
/// imports.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "leaves: values and helpers that import nothing above them",
        &[
            "error_chain",
            "fnv",
            "header_name",
            "lsn",
            "metrics",
            "pgoutput",
            "position",
            "progress",
            "relay_word",
            "secret_file",
            "testkit",
            "text",
            "timeline",
            "warning",
        ],
    ),
    (
        "the servers' protocols and the contracts: how the relay talks and what it checks against",
        &["route", "schema", "source", "telemetry"],
    ),
    (
        "settings, the event and the NATS connection: `nats` connects with the settings",
        &["catalog", "config", "event", "nats", "reload"],
    ),
    (
        "the path: stage, message, sink, and what serves beside it",
        &[
            "backfill_marker",
            "http",
            "message",
            "outbox",
            "parking",
            "sink",
            "slot_scan",
            "stored",
            "tail",
        ],
    ),
    (
        "operator tools",
        &[
            "backfill",
            "check_schemas",
            "parking_ops",
            "setup",
            "slot_mark",
            "status",
            "verify",
        ],
    ),
    ("the relay, which wires them", &["relay"]),
];

/// Every `.rs` file under `dir`, at any depth (`long_functions.rs` reads `src/` with it too).
pub(crate) fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file under `src` belongs to (`None` for the crate roots).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).expect("under src");
    let first = rel.components().next()?.as_os_str().to_str()?.to_owned();
    let name = first.strip_suffix(".rs").unwrap_or(&first).to_owned();
    (name != "lib" && name != "main").then_some(name)
}

/// The top-level modules a line of code names through `crate::` (a group `crate::{a, b::c}`
/// names each of its members).
fn named(line: &str, out: &mut BTreeSet<String>) {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut rest = line;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            // The group's top-level members: split at commas outside nested braces.
            let mut depth = 0;
            let mut start = 0;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.insert(ident(group[start..j].trim()));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(ident(group[start..j].trim()));
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident(after));
        }
        rest = after;
    }
}

/// Edges between top-level modules, and every module.
fn graph() -> (BTreeMap<String, BTreeSet<String>>, BTreeSet<String>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut modules = BTreeSet::new();
    for f in &files {
        modules.extend(module_of(&src, f));
    }
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let Some(from) = module_of(&src, f) else {
            continue;
        };
        let text = std::fs::read_to_string(f).expect("read source");
        let mut to = BTreeSet::new();
        for line in text.lines() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            // A trailing comment is not code either.
            let code = code.split(" // ").next().unwrap_or(code);
            named(code, &mut to);
        }
        let e = edges.entry(from.clone()).or_default();
        e.extend(to.into_iter().filter(|m| *m != from && modules.contains(m)));
    }
    (edges, modules)
}

/// Tarjan's strongly connected components with more than one module.
fn cycles(
    edges: &BTreeMap<String, BTreeSet<String>>,
    modules: &BTreeSet<String>,
) -> Vec<BTreeSet<String>> {
    struct T<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        if let Some(next) = t.edges.get(v) {
            for w in next {
                let w = w.as_str();
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let lw = t.low[w];
                    let lv = t.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if t.on.contains(w) {
                    let iw = t.index[w];
                    let lv = t.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut c = BTreeSet::new();
            loop {
                let w = t.stack.pop().unwrap();
                t.on.remove(w);
                c.insert(w.to_owned());
                if w == v {
                    break;
                }
            }
            if c.len() > 1 {
                t.out.push(c);
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for m in modules {
        if !t.index.contains_key(m.as_str()) {
            visit(&mut t, m);
        }
    }
    t.out
}

/// A module of the library by its path from the crate root (`["sink", "batch"]`), and the file
/// that is its own (`src/sink/batch.rs`, or `src/sink/mod.rs` for `["sink"]`).
struct Module {
    path: Vec<String>,
    file: PathBuf,
}

/// Every module of the library that has a file, except the crate roots and test modules.
fn modules() -> Vec<Module> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files
        .into_iter()
        .filter_map(|file| {
            let rel = file.strip_prefix(&src).expect("under src").to_path_buf();
            let mut path: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let last = path.pop()?;
            let stem = last.strip_suffix(".rs")?.to_owned();
            if stem != "mod" {
                path.push(stem);
            }
            let root =
                path.is_empty() || (path.len() == 1 && (path[0] == "lib" || path[0] == "main"));
            (!root && !path.iter().any(|p| p == "tests")).then_some(Module { path, file })
        })
        .collect()
}

/// A file's code for the import reader: comments and the test module at its end cut off, lines
/// joined (a `use` may span several).
fn code_of(file: &Path) -> String {
    let text = std::fs::read_to_string(file).expect("read source");
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let code = line.trim_start();
        if code.starts_with("#[cfg(test)]")
            && lines.peek().is_some_and(|next| {
                next.trim_start()
                    .trim_start_matches("pub(super) ")
                    .starts_with("mod ")
            })
        {
            break;
        }
        let code = match code.find("//") {
            Some(i) => &code[..i],
            None => code,
        };
        out.push_str(code);
        out.push(' ');
    }
    out
}

/// The paths of a use tree or path starting at `s` (after a `::`): `a::b`, `{a::b, c::{d, e}}`,
/// each as its segments.
fn use_tree(s: &str) -> Vec<Vec<String>> {
    fn ident(s: &str) -> (&str, &str) {
        let end = s
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        (&s[..end], &s[end..])
    }
    fn tree<'a>(s: &'a str, prefix: &[String], out: &mut Vec<Vec<String>>) -> &'a str {
        let s = s.trim_start();
        if let Some(group) = s.strip_prefix('{') {
            let mut rest = group;
            loop {
                rest = tree(rest, prefix, out).trim_start();
                match rest.chars().next() {
                    Some(',') => rest = &rest[1..],
                    Some('}') => return &rest[1..],
                    _ => return rest,
                }
            }
        }
        let (name, rest) = ident(s);
        let mut path = prefix.to_vec();
        if !name.is_empty() && name != "self" {
            path.push(name.to_owned());
        }
        match rest.strip_prefix("::") {
            Some(more) if !name.is_empty() => tree(more, &path, out),
            _ => {
                out.push(path);
                rest
            }
        }
    }
    let mut out = Vec::new();
    tree(s, &[], &mut out);
    out
}

/// The modules (or items) a file of module `here` names, as paths from the crate root: through
/// `crate::`, `super::` (and `super::super::`), `self::`, or a child module's bare name.
fn references(here: &[String], children: &BTreeSet<String>, code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        let at_start = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b':');
        if !at_start || !code.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let rest = &code[i..];
        let (base, after): (Vec<String>, &str) = if let Some(r) = rest.strip_prefix("crate::") {
            (Vec::new(), r)
        } else if let Some(r) = rest.strip_prefix("self::") {
            (here.to_vec(), r)
        } else if rest.starts_with("super::") {
            let mut base = here.to_vec();
            let mut r = rest;
            while let Some(more) = r.strip_prefix("super::") {
                base.pop();
                r = more;
            }
            (base, r)
        } else if let Some(child) = children
            .iter()
            .find(|c| rest.starts_with(c.as_str()) && rest[c.len()..].starts_with("::"))
        {
            let mut base = here.to_vec();
            base.push(child.clone());
            (base, &rest[child.len() + 2..])
        } else {
            i += 1;
            continue;
        };
        for tail in use_tree(after) {
            let mut path = base.clone();
            path.extend(tail);
            out.push(path);
        }
        i += 1;
    }
    out
}

/// The import cycles inside folders (between a module's own file and its child modules, or among
/// the children) that the library has today, as (folder, the modules in each strongly connected
/// component; `mod` for the folder's own file). Shrink an entry when a cycle is broken; never grow
/// one. The sink, the relay and the NATS side have none; the rest, mostly children that import
/// what their folder's own file defines, are left for the pass over the operator tools.
const KNOWN_IN_FOLDERS: &[(&str, &[&str])] = &[
    (
        "backfill",
        &[
            "error",
            "mod",
            "port",
            "preflight",
            "publish",
            "servers",
            "slot",
            "snapshot",
        ],
    ),
    ("message", &["cloudevents", "dead_letter", "mod"]),
    ("outbox", &["context", "mod", "row"]),
    ("schema", &["budget", "mod"]),
    ("setup", &["check", "mod", "overlap", "postgres", "stream"]),
    ("stored", &["mod", "service"]),
    ("telemetry", &["mod", "otlp"]),
    ("testkit", &["db", "mod", "nats"]),
    (
        "verify",
        &[
            "compare",
            "findings",
            "look",
            "messages",
            "mod",
            "proof",
            "rows",
            "run",
            "side",
            "stream",
            "unreachable",
        ],
    ),
];

/// A graph's edges and its nodes.
type Graph = (BTreeMap<String, BTreeSet<String>>, BTreeSet<String>);

/// For every module with child modules: the graph between its own file (`mod`) and its children.
fn folder_graphs() -> BTreeMap<String, Graph> {
    let modules = modules();
    let mut graphs: BTreeMap<String, Graph> = BTreeMap::new();
    let children_of = |path: &[String]| -> BTreeSet<String> {
        modules
            .iter()
            .filter(|m| m.path.len() == path.len() + 1 && m.path.starts_with(path))
            .map(|m| m.path[path.len()].clone())
            .collect()
    };
    for m in &modules {
        let code = code_of(&m.file);
        let refs = references(&m.path, &children_of(&m.path), &code);
        // Every folder this module's file lies in (its parent's, its grandparent's, …).
        for depth in 0..m.path.len() {
            let folder = &m.path[..depth];
            if folder.is_empty() {
                continue;
            }
            let children = children_of(folder);
            if children.is_empty() {
                continue;
            }
            let from = m.path[depth].clone();
            let entry = graphs.entry(folder.join("/")).or_default();
            entry.1.extend(children.iter().cloned());
            entry.1.insert("mod".to_owned());
            for r in &refs {
                if r.len() <= depth || r[..depth] != *folder {
                    continue;
                }
                let to = if children.contains(&r[depth]) {
                    r[depth].clone()
                } else {
                    "mod".to_owned()
                };
                if to != from {
                    entry.0.entry(from.clone()).or_default().insert(to);
                }
            }
        }
        // The module's own file, in its own folder.
        let children = children_of(&m.path);
        if !children.is_empty() {
            let depth = m.path.len();
            let entry = graphs.entry(m.path.join("/")).or_default();
            entry.1.extend(children.iter().cloned());
            entry.1.insert("mod".to_owned());
            for r in &refs {
                if r.len() > depth && r[..depth] == m.path[..] && children.contains(&r[depth]) {
                    entry
                        .0
                        .entry("mod".to_owned())
                        .or_default()
                        .insert(r[depth].clone());
                }
            }
        }
    }
    graphs
}

#[test]
fn no_new_import_cycle_between_the_files_of_a_folder() {
    let mut found = Vec::new();
    for (folder, (edges, nodes)) in folder_graphs() {
        for c in cycles(&edges, &nodes) {
            let known = KNOWN_IN_FOLDERS
                .iter()
                .any(|(f, k)| *f == folder && c.iter().all(|m| k.contains(&m.as_str())));
            if !known {
                found.push(format!(
                    "src/{folder}: {c:?} (edges: {:?})",
                    c.iter()
                        .map(|m| (
                            m,
                            edges.get(m).map(|e| e.intersection(&c).collect::<Vec<_>>())
                        ))
                        .collect::<Vec<_>>()
                ));
            }
        }
    }
    assert!(
        found.is_empty(),
        "new import cycles between the files of a folder: {found:#?}; a child imports its siblings by \
         their own paths (`super::config::SinkConfig`, not `super::SinkConfig` through the folder's \
         mod.rs), and what two files share goes down into a file both import \
         (tests/integration/module_graph.rs)"
    );
    for (folder, known) in KNOWN_IN_FOLDERS {
        let graphs = folder_graphs();
        let (edges, nodes) = &graphs[*folder];
        let now: BTreeSet<String> = cycles(edges, nodes).into_iter().flatten().collect();
        let known: BTreeSet<String> = known.iter().map(|m| (*m).to_owned()).collect();
        assert!(
            known.is_subset(&now),
            "a known import cycle in src/{folder} got smaller: shrink its entry in KNOWN_IN_FOLDERS \
             to {now:?} (tests/integration/module_graph.rs)"
        );
    }
}

#[test]
fn the_folder_reader_resolves_super_self_and_child_paths() {
    let here = |p: &str| p.split('/').map(str::to_owned).collect::<Vec<_>>();
    let children: BTreeSet<String> = ["fit".to_owned()].into();
    let refs = references(
        &here("sink/batch"),
        &children,
        "use super::{config::SinkConfig, error::SinkError}; use crate::sink::window::{Held, InFlight}; \
         fit::smaller(); use self::fit::Limit; let x = super::super::text::cut(s, 1);",
    );
    let has = |p: &str| refs.contains(&here(p));
    assert!(has("sink/config/SinkConfig"), "{refs:?}");
    assert!(has("sink/error/SinkError"), "{refs:?}");
    assert!(
        has("sink/window/Held") && has("sink/window/InFlight"),
        "{refs:?}"
    );
    assert!(has("sink/batch/fit/smaller"), "{refs:?}");
    assert!(has("sink/batch/fit/Limit"), "{refs:?}");
    assert!(has("text/cut"), "{refs:?}");
}

#[test]
fn no_new_import_cycle_between_top_level_modules() {
    let (edges, modules) = graph();
    let found = cycles(&edges, &modules);
    let known: Vec<BTreeSet<String>> = KNOWN
        .iter()
        .map(|c| c.iter().map(|m| (*m).to_owned()).collect())
        .collect();
    for c in &found {
        assert!(
            known.iter().any(|k| c.is_subset(k)),
            "a new import cycle between {c:?}: break it (a leaf module for what they share), or \
             see tests/integration/module_graph.rs; the edges: {:?}",
            c.iter()
                .map(|m| (m, edges[m].intersection(c).collect::<Vec<_>>()))
                .collect::<Vec<_>>()
        );
    }
    for k in &known {
        let now: BTreeSet<String> = found
            .iter()
            .filter(|c| c.is_subset(k))
            .flatten()
            .cloned()
            .collect();
        assert_eq!(
            &now, k,
            "a known import cycle got smaller: shrink its entry in KNOWN \
             (tests/integration/module_graph.rs) to the modules still in a cycle, so that it cannot \
             grow back"
        );
    }
}

/// The operator tools: they read the servers and say what they found, and publish nothing. None
/// of them imports the sink, so none depends on how the relay publishes: what they read of the
/// stream's tail comes from `tail`, which sits below both. `backfill` is not among them: it
/// publishes existing rows through the sink by design, as live events are published.
const OPERATOR_TOOLS: &[&str] = &[
    "check_schemas",
    "relay_word",
    "setup",
    "slot_mark",
    "slot_scan",
    "status",
    "verify",
];

#[test]
fn no_operator_tool_imports_the_sink_and_the_tail_imports_neither_sink_nor_source() {
    let (edges, modules) = graph();
    for m in OPERATOR_TOOLS {
        assert!(
            modules.contains(*m),
            "OPERATOR_TOOLS names {m}, which is no module any more: drop it \
             (tests/integration/module_graph.rs)"
        );
    }
    let into_sink: Vec<&str> = OPERATOR_TOOLS
        .iter()
        .copied()
        .filter(|m| edges.get(*m).is_some_and(|to| to.contains("sink")))
        .collect();
    assert!(
        into_sink.is_empty(),
        "operator tools that import the sink: {into_sink:?}; what they need of the stream's tail is \
         in src/tail/, and anything else they share with the sink goes down into a module both \
         import (tests/integration/module_graph.rs)"
    );
    let tail = edges.get("tail").cloned().unwrap_or_default();
    assert!(
        !tail.contains("sink") && !tail.contains("source"),
        "src/tail/ imports {tail:?}: it sits below the sink and the operator tools, and takes what \
         the replication connection says as plain values (tests/integration/module_graph.rs)"
    );
}

#[test]
fn no_import_runs_from_a_lower_layer_to_a_higher_one() {
    let (edges, modules) = graph();
    let layer = |m: &str| LAYERS.iter().position(|(_, ms)| ms.contains(&m));
    for m in &modules {
        assert!(
            layer(m).is_some(),
            "module {m} has no layer: give it one in LAYERS (tests/integration/module_graph.rs)"
        );
    }
    for (_, ms) in LAYERS {
        for m in *ms {
            assert!(
                modules.contains(*m),
                "LAYERS names {m}, which is no module any more: drop it \
                 (tests/integration/module_graph.rs)"
            );
        }
    }
    let upward: Vec<String> = edges
        .iter()
        .flat_map(|(from, to)| to.iter().map(move |to| (from, to)))
        .filter(|(from, to)| layer(to) > layer(from))
        .map(|(from, to)| {
            let name = |m: &str| LAYERS[layer(m).unwrap()].0.split(':').next().unwrap();
            format!("{from} ({}) → {to} ({})", name(from), name(to))
        })
        .collect();
    assert!(
        upward.is_empty(),
        "imports from a lower layer to a higher one: {upward:?}; move what the lower module needs \
         down into a leaf, or, if the module belongs higher, move it up in LAYERS \
         (tests/integration/module_graph.rs)"
    );
}

#[test]
fn the_graph_reader_sees_paths_groups_and_skips_comments() {
    let mut out = BTreeSet::new();
    named(
        "use crate::{config::Settings, sink::{self, Sink}, Lsn};",
        &mut out,
    );
    named("let x = crate::metrics::Metrics::default();", &mut out);
    assert_eq!(
        out.into_iter().collect::<Vec<_>>(),
        ["Lsn", "config", "metrics", "sink"]
    );
    let mut edges = BTreeMap::new();
    let m = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<BTreeSet<_>>();
    edges.insert("a".to_owned(), m(&["b"]));
    edges.insert("b".to_owned(), m(&["c"]));
    edges.insert("c".to_owned(), m(&["a"]));
    edges.insert("d".to_owned(), m(&["a"]));
    assert_eq!(
        cycles(&edges, &m(&["a", "b", "c", "d"])),
        vec![m(&["a", "b", "c"])]
    );
}
