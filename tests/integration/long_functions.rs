//! No function in `src/` longer than [`MAX_LINES`] lines, outside the few in [`ALLOWED`], each with
//! its reason. A long function is read whole before any part of it can be changed; split it into
//! named steps that read as the story instead of raising the limit or growing the list.
//!
//! A function's length is its lines from the one with `fn` to the one with its closing brace, both
//! counted (its doc comment and attributes are not). The reader is textual, like `module_graph.rs`:
//! comments, strings and character literals are blanked out first, so a brace inside them does not
//! count, and the body is the first `{` after `fn` outside parentheses and angle brackets.

use std::path::Path;

use crate::module_graph::rust_files;

/// Longer than this is too long to read in one go.
const MAX_LINES: usize = 80;

/// The functions allowed over [`MAX_LINES`], as (file under `src/`, function name, why it stays
/// long). An entry goes when its function is split: the test fails on an entry whose function is no
/// longer over the limit, so the list only shrinks.
const ALLOWED: &[(&str, &str, &str)] = &[];

/// `text` with every comment, string and character literal replaced by spaces, newlines kept, so
/// line numbers and brace matching see only code.
fn blanked(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, cs: &[char]| {
        out.extend(cs.iter().map(|&c| if c == '\n' { '\n' } else { ' ' }));
    };
    let mut i = 0;
    while i < chars.len() {
        let end = literal_end(&chars, i);
        if end > i {
            blank(&mut out, &chars[i..end]);
            i = end;
        } else {
            out.push(chars[i]);
            i += 1;
        }
    }
    out
}

/// Where the comment or literal starting at `i` ends (`i` itself when none starts there).
fn literal_end(cs: &[char], i: usize) -> usize {
    let at = |k: usize| cs.get(k).copied().unwrap_or('\0');
    let ident_before = i > 0 && (cs[i - 1].is_alphanumeric() || cs[i - 1] == '_');
    match (at(i), at(i + 1)) {
        ('/', '/') => (i..cs.len()).find(|&k| cs[k] == '\n').unwrap_or(cs.len()),
        ('/', '*') => {
            // Block comments nest in Rust.
            let (mut depth, mut k) = (0, i);
            while k < cs.len() {
                if at(k) == '/' && at(k + 1) == '*' {
                    depth += 1;
                    k += 2;
                } else if at(k) == '*' && at(k + 1) == '/' {
                    depth -= 1;
                    k += 2;
                    if depth == 0 {
                        return k;
                    }
                } else {
                    k += 1;
                }
            }
            cs.len()
        }
        ('r', '"' | '#') if !ident_before => {
            let hashes = cs[i + 1..].iter().take_while(|&&c| c == '#').count();
            if at(i + 1 + hashes) != '"' {
                return i;
            }
            let mut k = i + 2 + hashes;
            while k < cs.len() {
                if cs[k] == '"' && (1..=hashes).all(|h| at(k + h) == '#') {
                    return k + 1 + hashes;
                }
                k += 1;
            }
            cs.len()
        }
        ('"', _) => {
            let mut k = i + 1;
            while k < cs.len() && cs[k] != '"' {
                k += if cs[k] == '\\' { 2 } else { 1 };
            }
            (k + 1).min(cs.len())
        }
        // A character literal ('x', '\n', '\u{1F600}'), not a lifetime ('a).
        ('\'', '\\') => (i + 3..cs.len())
            .find(|&k| cs[k] == '\'')
            .map_or(cs.len(), |k| k + 1),
        ('\'', _) if at(i + 2) == '\'' => i + 3,
        _ => i,
    }
}

/// Every function in `code` (blanked) with a body, as (name, line of `fn`, length in lines).
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let bytes = code.as_bytes();
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(off) = code[from..].find("fn ") {
        let at = from + off;
        from = at + 3;
        if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
            continue;
        }
        let name: String = code[at + 3..]
            .trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue; // `fn(u8) -> u8`, a function pointer type
        }
        let Some(open) = body_start(bytes, at + 3) else {
            continue; // a declaration in a trait: no body
        };
        let mut depth = 0;
        let close = (open..bytes.len()).find(|&k| {
            match bytes[k] {
                b'{' => depth += 1,
                b'}' => depth -= 1,
                _ => {}
            }
            depth == 0
        });
        let close = close.unwrap_or(bytes.len() - 1);
        found.push((name, line_of(at), line_of(close) - line_of(at) + 1));
    }
    found
}

/// The body's `{` after a signature starting at `from`: the first one outside parentheses,
/// brackets and generics, or `None` when a `;` ends the signature first.
fn body_start(bytes: &[u8], from: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (k, &b) in bytes.iter().enumerate().skip(from) {
        match b {
            b'(' | b'[' | b'<' => depth += 1,
            // `->` is not a closing bracket.
            b'>' if bytes[k - 1] == b'-' => {}
            b')' | b']' | b'>' => depth -= 1,
            b';' if depth <= 0 => return None,
            b'{' if depth <= 0 => return Some(k),
            _ => {}
        }
    }
    None
}

/// The functions over [`MAX_LINES`] in `src/`, as (file under `src/`, name, line, length).
fn long_functions() -> Vec<(String, String, usize, usize)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut long = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&src).expect("under src");
        let rel = rel.to_string_lossy().replace('\\', "/");
        let code = blanked(&std::fs::read_to_string(&file).expect("read source"));
        for (name, line, len) in functions(&code) {
            if len > MAX_LINES {
                long.push((rel.clone(), name, line, len));
            }
        }
    }
    long
}

#[test]
fn no_function_in_src_is_over_80_lines_outside_the_allowed_few() {
    let long = long_functions();
    let new: Vec<String> = long
        .iter()
        .filter(|(file, name, ..)| !ALLOWED.iter().any(|(f, n, _)| f == file && n == name))
        .map(|(file, name, line, len)| format!("src/{file}:{line} {name} ({len} lines)"))
        .collect();
    assert!(
        new.is_empty(),
        "functions over {MAX_LINES} lines: {new:?}; split each into named steps \
         (tests/integration/long_functions.rs says how they are counted)"
    );
    let gone: Vec<&str> = ALLOWED
        .iter()
        .filter(|(f, n, _)| !long.iter().any(|(file, name, ..)| file == f && name == n))
        .map(|(_, n, _)| *n)
        .collect();
    assert!(
        gone.is_empty(),
        "{gone:?} are no longer over {MAX_LINES} lines: take them out of ALLOWED"
    );
    assert!(ALLOWED.len() <= 3, "at most 3 long functions");
}

#[test]
fn the_reader_counts_from_fn_to_its_brace_and_skips_braces_in_comments_and_strings() {
    let code = blanked(
        "/// fn doc() {\n\
         fn a() -> Vec<u8> {\n\
             let s = \"}}\"; // }\n\
             let r = r#\"{\"#; let c = '{'; let l: &'static str = \"\";\n\
             /* } /* } */ } */\n\
         }\n\
         trait T { fn b(&self); fn c(&self) { } }\n\
         fn d<F: Fn(u8) -> u8>(f: F)\n    where F: Copy\n{\n}\n",
    );
    let found = functions(&code);
    let named: Vec<(&str, usize, usize)> = found
        .iter()
        .map(|(n, line, len)| (n.as_str(), *line, *len))
        .collect();
    assert_eq!(named, [("a", 2, 5), ("c", 7, 1), ("d", 8, 4)]);
}
