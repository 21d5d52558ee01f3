//! Unit tests of the schema directory loader and the payload check: what passes, the one-line
//! reasons of what fails, and the load errors that name the file.

use super::*;

fn dir(files: &[(&str, &str)]) -> tempfile::TempDir {
    let d = tempfile::tempdir().expect("tempdir");
    for (name, text) in files {
        std::fs::write(d.path().join(name), text).expect("write schema");
    }
    d
}

fn load(d: &tempfile::TempDir, required: bool) -> Result<SchemaSet, LoadError> {
    SchemaSet::load(d.path().to_str().expect("utf-8 path"), required)
}

const CLAIM: &str = r#"{
    "$id": "https://schemas.example.com/ClaimApproved.json",
    "type": "object",
    "required": ["claim", "amount"],
    "properties": {
        "claim": {"type": "integer"},
        "amount": {"$ref": "common.json#/$defs/amount"}
    }
}"#;
const COMMON: &str = r#"{"$defs": {"amount": {"type": "number", "minimum": 0}}}"#;

#[test]
fn passes_and_names_the_first_failure() {
    let d = dir(&[("ClaimApproved.json", CLAIM), ("common.json", COMMON)]);
    let set = load(&d, false).expect("loads");
    assert_eq!(set.len(), 2);
    assert_eq!(
        set.check(
            "ClaimApproved",
            br#"{"claim": 4711, "amount": 12.5}"#,
            false
        ),
        Verdict::Pass(Some(
            "https://schemas.example.com/ClaimApproved.json".into()
        ))
    );
    assert_eq!(
        set.check("ClaimApproved", br#"{"claim": "4711", "amount": 1}"#, false),
        Verdict::Fail(r#"ClaimApproved: /claim: "4711" is not of type "integer" (type)"#.into())
    );
    assert_eq!(
        set.check("ClaimApproved", br#"{"claim": 1}"#, false),
        Verdict::Fail(
            r#"ClaimApproved: (root): "amount" is a required property (required)"#.into()
        )
    );
    // minimum, through the $ref to the other file.
    assert_eq!(
        set.check("ClaimApproved", br#"{"claim": 1, "amount": -3}"#, false),
        Verdict::Fail("ClaimApproved: /amount: -3 is less than the minimum of 0 (minimum)".into())
    );
}

#[test]
fn payloads_that_are_not_json_fail_and_types_without_schema_pass_unless_required() {
    let d = dir(&[("ClaimApproved.json", CLAIM), ("common.json", COMMON)]);
    let set = load(&d, false).expect("loads");
    let Verdict::Fail(why) = set.check("ClaimApproved", b"\x00\x01", true) else {
        panic!("raw bytes pass")
    };
    assert!(
        why.starts_with("ClaimApproved: the bytea payload is not JSON"),
        "{why}"
    );
    let Verdict::Fail(why) = set.check("ClaimApproved", b"", false) else {
        panic!("an empty payload passes")
    };
    assert!(why.contains("empty"), "{why}");
    // Not parsed at all: no schema.
    assert_eq!(
        set.check("ClaimRejected", b"not json", false),
        Verdict::NoSchema
    );
    let required = load(&d, true).expect("loads");
    let Verdict::Fail(why) = required.check("ClaimRejected", b"{}", false) else {
        panic!("a type without a schema passes although schemas are required")
    };
    assert!(why.contains("no schema ClaimRejected.json"), "{why}");
}

#[test]
fn a_schema_without_id_resolves_a_relative_ref_to_a_sibling() {
    let d = dir(&[
        (
            "Paid.json",
            r#"{"properties": {"amount": {"$ref": "common.json#/$defs/amount"}}}"#,
        ),
        ("common.json", COMMON),
    ]);
    let set = load(&d, false).expect("loads");
    assert_eq!(
        set.check("Paid", br#"{"amount": 1}"#, false),
        Verdict::Pass(None)
    );
    assert!(matches!(
        set.check("Paid", br#"{"amount": -1}"#, false),
        Verdict::Fail(_)
    ));
}

#[test]
fn a_directory_that_does_not_load_names_the_file_and_the_problem() {
    let d = dir(&[("Bad.json", "{not json")]);
    let e = load(&d, false).unwrap_err();
    assert_eq!(e.file, d.path().join("Bad.json"));
    assert!(e.to_string().contains("Bad.json: is not JSON"), "{e}");

    let d = dir(&[("Bad.json", r#"{"type": "no-such-type"}"#)]);
    let e = load(&d, false).unwrap_err();
    assert!(e.to_string().contains("Bad.json: "), "{e}");

    let d = dir(&[("Ref.json", r#"{"$ref": "missing.json"}"#)]);
    let e = load(&d, false).unwrap_err();
    assert!(
        e.to_string().contains("Ref.json: ") && e.to_string().contains("missing.json"),
        "{e}"
    );
    assert!(!e.to_string().contains('\n'), "{e}");

    // Remote references are never fetched.
    let d = dir(&[(
        "Remote.json",
        r#"{"$ref": "https://example.com/x/other.json"}"#,
    )]);
    let e = load(&d, false).unwrap_err();
    assert!(e.to_string().contains("never fetched"), "{e}");

    let e = SchemaSet::load("/no/such/schema/dir", false).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("/no/such/schema/dir: cannot read the directory"),
        "{e}"
    );
}

#[test]
fn other_files_are_not_schemas() {
    let d = dir(&[
        ("A.json", "true"),
        ("notes.txt", "x"),
        (".hidden.json", "{"),
    ]);
    assert_eq!(load(&d, false).expect("loads").len(), 1);
}

#[test]
fn off_is_inactive_and_a_reader_sees_a_replaced_set() {
    assert!(!SchemaSet::load("", false).expect("off").active());
    let schemas = Schemas::new(SchemaSet::default());
    let mut reader = schemas.reader();
    assert!(reader.get().is_empty());
    let d = dir(&[("A.json", "false")]);
    schemas.replace(Arc::new(load(&d, false).expect("loads")));
    assert_eq!(reader.get().len(), 1);
    assert!(matches!(
        reader.get().check("A", b"{}", false),
        Verdict::Fail(_)
    ));
}

#[test]
fn failures_are_counted_by_type_and_rendered() {
    let m = SchemaMetrics::default();
    m.failed("ClaimApproved");
    m.failed("ClaimApproved");
    m.failed("we\"ird");
    let mut out = String::new();
    m.render(&mut out);
    assert!(
        out.contains("outbox_relay_schema_failures_total{event_type=\"ClaimApproved\"} 2"),
        "{out}"
    );
    assert!(out.contains("{event_type=\"we\\\"ird\"} 1"), "{out}");
    assert!(
        out.contains("outbox_relay_schema_reloads_total{result=\"failed\"} 0"),
        "{out}"
    );
}

/// Patterns run on the `regex` engine (linear in the payload): lookaround and backreferences, which
/// need backtracking (the pattern `^(\w+\s?)*(?<!\s)$` kept the relay busy for seconds on one 35 KB
/// payload), are refused when the schemas load, in `pattern` and in `patternProperties`, with one
/// line naming the file, where the pattern is, the pattern and why.
#[test]
fn backtracking_patterns_are_refused_at_load_with_the_file_and_the_pattern() {
    for (pattern, shown) in [
        (r"^(\w+\s?)*(?<!\s)$", r#""^(\\w+\\s?)*(?<!\\s)$""#),
        (r"^(?=a)", r#""^(?=a)""#),
        (r"foo(?!bar)", r#""foo(?!bar)""#),
        (r"(?<=x)y", r#""(?<=x)y""#),
        (r"(a)\1", r#""(a)\\1""#),
        ("[", r#""[""#),
    ] {
        for (schema, at) in [
            (
                serde_json::json!({"type": "object", "properties": {"name": {"type": "string", "pattern": pattern}}}),
                "/properties/name/pattern",
            ),
            (
                serde_json::json!({"type": "object", "patternProperties": {pattern: {}}}),
                "/patternProperties",
            ),
        ] {
            let d = dir(&[("ClaimApproved.json", &schema.to_string())]);
            let e = load(&d, false).expect_err(pattern).to_string();
            assert!(e.contains("ClaimApproved.json: "), "{pattern}: {e}");
            assert!(e.contains(at), "{pattern}: {e}");
            assert!(
                e.contains(&format!("pattern {shown} is refused")),
                "{pattern}: {e}"
            );
            assert!(e.contains("linear time"), "{pattern}: {e}");
            assert!(!e.contains('\n'), "{pattern}: {e}");
        }
    }
}

/// What the `regex` engine does support still loads and checks: classes, Unicode properties,
/// anchors, counted repetition, non-capturing groups.
#[test]
fn linear_patterns_load_and_check() {
    let schema = r#"{"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{4}$"},
        "name": {"type": "string", "pattern": "^\\p{L}+(?: \\p{L}+)*$"}
    }}"#;
    let d = dir(&[("ClaimApproved.json", schema)]);
    let set = load(&d, false).expect("loads");
    assert_eq!(
        set.check(
            "ClaimApproved",
            r#"{"code": "DE-4711", "name": "Jürgen Weiß"}"#.as_bytes(),
            false
        ),
        Verdict::Pass(None)
    );
    let Verdict::Fail(why) = set.check("ClaimApproved", br#"{"code": "DE-47"}"#, false) else {
        panic!("a code that does not match passes")
    };
    assert!(why.starts_with("ClaimApproved: /code: "), "{why}");
    assert!(why.ends_with("(pattern)"), "{why}");
}
