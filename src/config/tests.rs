//! Unit tests of the whole loading path, file and environment through validation, as
//! [`Config::load`] runs it: defaults, `name`, the environment layer, and each key's refusal in one
//! line naming the key and its variable.

use super::*;
use std::io::Write;

fn load(toml_text: &str, env: &[(&str, &str)]) -> Result<Settings, ConfigError> {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(toml_text.as_bytes()).unwrap();
    Config::load_with_env(
        Some(f.path()),
        env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
    )
}

#[test]
fn defaults_are_valid_and_match_the_contract() {
    let c = Config::load_with_env(None, Vec::new()).unwrap();
    assert_eq!(c.config().postgres.slot, "outbox_relay");
    assert_eq!(c.config().outbox.table, "public.outbox");
    assert_eq!(c.config().nats.subject, "outbox.{aggregate_type}");
    assert_eq!(c.config().nats.dead_letter_subject, "outbox_dead_letter");
    assert_eq!(c.config().http.listen, "127.0.0.1:9187");
    assert_eq!(c.config().outbox.on_invalid, OnInvalid::DeadLetter);
    // sql/06's helper publishes with the default configuration; "" is the explicit opt-out.
    assert_eq!(c.config().outbox.message_prefix, "outbox");
    let off = load("[outbox]\nmessage_prefix = \"\"\n", &[]).unwrap();
    assert_eq!(off.config().outbox.message_prefix, "");
    let off = load("", &[("OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX", "")]).unwrap();
    assert_eq!(off.config().outbox.message_prefix, "");
}

#[test]
fn name_derives_the_relays_names_and_explicit_keys_win() {
    let c = load("name = \"orders\"\n", &[]).unwrap();
    let c = c.config();
    assert_eq!(c.postgres.slot, "outbox_relay_orders");
    assert_eq!(c.postgres.publication, "outbox_relay_orders");
    assert_eq!(c.nats.stream, "OUTBOX_ORDERS");
    assert_eq!(c.nats.subject, "orders.{aggregate_type}");
    assert_eq!(c.nats.dead_letter_subject, "orders_dead_letter");
    // "" keeps today's names.
    let c = load("name = \"\"\n", &[]).unwrap();
    assert_eq!(c.config().postgres.slot, "outbox_relay");
    assert_eq!(c.config().nats.stream, "OUTBOX");
    // The environment form, and explicit keys from the file and the environment, even when they
    // equal a default.
    let c = load(
        "[postgres]\nslot = \"outbox_relay\"\n[nats]\nsubject = \"claims.{event_type}\"\n",
        &[
            ("OUTBOX_RELAY_NAME", "claims"),
            ("OUTBOX_RELAY_NATS_STREAM", "CLAIMS"),
        ],
    )
    .unwrap();
    let c = c.config();
    assert_eq!(c.name, "claims");
    assert_eq!(c.postgres.slot, "outbox_relay", "explicit in the file");
    assert_eq!(c.nats.stream, "CLAIMS", "explicit in the environment");
    assert_eq!(c.nats.subject, "claims.{event_type}");
    assert_eq!(c.postgres.publication, "outbox_relay_claims", "derived");
    assert_eq!(c.nats.dead_letter_subject, "claims_dead_letter", "derived");
    // The environment wins over the file's name.
    let c = load("name = \"orders\"\n", &[("OUTBOX_RELAY_NAME", "billing")]).unwrap();
    assert_eq!(c.config().nats.stream, "OUTBOX_BILLING");
    for bad in ["Orders", "or.ders", "or-ders", "a b", "x*", &"n".repeat(51)] {
        let e = load(&format!("name = {bad:?}\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("config name (env OUTBOX_RELAY_NAME): ")
                && e.contains("not a valid relay name"),
            "{bad:?}: {e}"
        );
        assert!(!e.contains('\n'), "{e}");
    }
    assert!(load(&format!("name = {:?}\n", "n".repeat(50)), &[]).is_ok());
}

#[test]
fn the_documented_complete_relay_toml_has_only_real_keys() {
    // docs/configuration.md, "A complete relay.toml": every key, `name` at the top level.
    let doc = include_str!("../../docs/configuration.md");
    let (_, section) = doc.split_once("\n## A complete relay.toml\n").unwrap();
    let (_, block) = section.split_once("```toml\n").unwrap();
    let (block, _) = block.split_once("\n```").unwrap();
    let table: toml::Table = block.parse().unwrap();
    let config = Config::deserialize(toml::Value::Table(table)).unwrap();
    assert_eq!(config.name, "");
}

#[test]
fn env_wins_over_file_and_is_typed() {
    let c = load(
        "[postgres]\nslot = \"from_file\"\n[nats]\nmax_in_flight = 10\n",
        &[
            ("OUTBOX_RELAY_POSTGRES_SLOT", "from_env"),
            ("OUTBOX_RELAY_NATS_MAX_IN_FLIGHT", "20"),
            ("OUTBOX_RELAY_POSTGRES_CREATE_SLOT", "false"),
            ("UNRELATED", "x"),
        ],
    )
    .unwrap();
    assert_eq!(c.config().postgres.slot, "from_env");
    assert_eq!(c.config().nats.max_in_flight, 20);
    assert!(!c.config().postgres.create_slot);
}

#[test]
fn acknowledged_warnings_must_be_warnings_and_the_grace_is_bounded() {
    let c = load(
        "[warnings]\nacknowledged = [\"unrelayed-message-helper\"]\n[status]\ngrace_secs = 5\n",
        &[],
    )
    .unwrap();
    assert_eq!(
        c.config().warnings.acknowledged,
        ["unrelayed-message-helper"]
    );
    assert_eq!(c.config().status.grace_secs, 5);
    let e = load(
        "",
        &[(
            "OUTBOX_RELAY_WARNINGS_ACKNOWLEDGED",
            "dead-letters,unrelayed-helper",
        )],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("warnings.acknowledged") && e.contains("names no warning: unrelayed-helper"),
        "{e}"
    );
    let e = load("[status]\ngrace_secs = 7200\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("status.grace_secs") && e.contains("at most 3600"),
        "{e}"
    );
}

#[test]
fn unknown_keys_are_errors_naming_them() {
    let e = load("[postgres]\nslto = \"x\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("slto"), "{e}");
    let e = load("[postgress]\n", &[]).unwrap_err().to_string();
    assert!(e.contains("postgress"), "{e}");
}

#[test]
fn variables_that_name_no_setting_do_not_stop_the_relay() {
    // Kubernetes injects these for a Service named outbox-relay.
    let c = load(
        "",
        &[
            ("OUTBOX_RELAY_SERVICE_HOST", "10.0.0.1"),
            ("OUTBOX_RELAY_PORT_9187_TCP", "tcp://10.0.0.1:9187"),
        ],
    )
    .unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    // A near miss of a real key is a warning naming both.
    let c = load("", &[("OUTBOX_RELAY_NATS_STREEM", "x")]).unwrap();
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    let w = &c.warnings[0].text;
    assert!(
        w.contains("OUTBOX_RELAY_NATS_STREEM") && w.contains("OUTBOX_RELAY_NATS_STREAM"),
        "{w}"
    );
    assert_eq!(c.warnings[0].name, "unknown-variable");
}

#[test]
fn env_values_are_checked_against_their_own_variable() {
    let e = load("", &[("OUTBOX_RELAY_OUTBOX_ON_INVALID", "explode")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("OUTBOX_RELAY_OUTBOX_ON_INVALID"), "{e}");
    let c = load("", &[("OUTBOX_RELAY_NATS_FENCE", "TRUE")]).unwrap();
    assert!(c.config().nats.fence);
    let c = load("", &[("OUTBOX_RELAY_NATS_FENCE", "Off")]).unwrap();
    assert!(!c.config().nats.fence);
}

#[test]
fn partition_placeholder_needs_partitions() {
    let e = load(
        "[nats]\nsubject = \"outbox.{aggregate_type}.{partition}\"",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("nats.partitions") && e.contains("{partition}"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(
        !e.contains("  "),
        "no run of spaces from a line continuation: {e}"
    );
    let c = load(
        "[nats]\nsubject = \"outbox.{aggregate_type}.{partition}\"",
        &[("OUTBOX_RELAY_NATS_PARTITIONS", "4")],
    )
    .unwrap();
    assert_eq!(c.config().nats.partitions, 4);
    assert_eq!(c.subject.partition_wildcards().len(), 4);
    let e = load("[nats]\npartitions = 10001", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("nats.partitions"), "{e}");
}

/// Where the position service may answer (docs/security.md, round 5, findings 1 and 2): requesters'
/// inboxes only, by default `_INBOX.`; a prefix that could name the stream's subjects, the service's
/// own, `$…` subjects or the relay's own inbox is refused in one line naming the key.
#[test]
fn service_reply_prefixes_are_inbox_prefixes_outside_everything_the_relay_keeps() {
    let key = "OUTBOX_RELAY_NATS_SERVICE_REPLY_PREFIXES";
    assert_eq!(
        load("", &[]).unwrap().config().nats.service_reply_prefixes,
        ["_INBOX."]
    );
    let c = load("", &[(key, "_INBOX., _R_.")]).unwrap();
    assert_eq!(c.config().nats.service_reply_prefixes, ["_INBOX.", "_R_."]);
    let c = load(
        "[nats]\nservice_reply_prefixes = [\"_INBOX_claims.\"]\n",
        &[],
    )
    .unwrap();
    assert_eq!(c.config().nats.service_reply_prefixes, ["_INBOX_claims."]);
    // A relay inbox inside an allowed prefix is refused per request, not here.
    assert!(load("", &[("OUTBOX_RELAY_NATS_INBOX_PREFIX", "_INBOX.relay")]).is_ok());
    let long = format!("{}.", "i".repeat(64));
    for (bad, why) in [
        ("", "is empty"),
        ("_INBOX", "does not end with '.'"),
        ("_INBOX.*.", "invalid"),
        ("$JS.", "reserves"),
        ("a..", "invalid"),
        (long.as_str(), "more than 64"),
        ("outbox.", "nats.subject"),
        ("outbox-relay.", "position service"),
    ] {
        let e = load("", &[(key, bad)]).unwrap_err().to_string();
        assert!(
            e.contains("nats.service_reply_prefixes") && e.contains(key) && e.contains(why),
            "{bad:?}: {e}"
        );
        assert!(!e.contains('\n'), "{e}");
    }
    // The relay's own inbox, unless it is the shared `_INBOX` every client publishes under anyway.
    let e = load(
        "",
        &[
            ("OUTBOX_RELAY_NATS_INBOX_PREFIX", "_INBOX_outbox_relay"),
            (key, "_INBOX_outbox_relay.,_INBOX."),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("inside the relay's own inbox"), "{e}");
}

#[test]
fn inbox_prefix_is_literal_and_outside_the_stream() {
    assert_eq!(load("", &[]).unwrap().config().nats.inbox_prefix, "_INBOX");
    let c = load(
        "[nats]\ninbox_prefix = \"_INBOX_outbox_relay\"",
        &[("OUTBOX_RELAY_NATS_INBOX_PREFIX", "_INBOX_relay.claims")],
    )
    .unwrap();
    assert_eq!(c.config().nats.inbox_prefix, "_INBOX_relay.claims");
    for bad in ["", "a.*", "_INBOX.>", "$JS", "a..b", "has space", "outbox"] {
        let e = load("", &[("OUTBOX_RELAY_NATS_INBOX_PREFIX", bad)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("nats.inbox_prefix"), "{bad:?}: {e}");
    }
    // `outbox.>` would take in the default template's `outbox.*`.
    let e = load("", &[("OUTBOX_RELAY_NATS_INBOX_PREFIX", "outbox")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("overlaps nats.subject"), "{e}");
    // Under the position service's subjects, where its callers may publish (docs/security.md,
    // finding 11).
    for bad in ["outbox-relay", "outbox-relay.inbox", "outbox-relay.s.wait"] {
        let e = load("", &[("OUTBOX_RELAY_NATS_INBOX_PREFIX", bad)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("nats.inbox_prefix")
                && e.contains("overlaps the position service's subjects outbox-relay.>"),
            "{bad:?}: {e}"
        );
        assert!(!e.contains('\n'), "{e}");
    }
    for good in ["outbox-relay_inbox", "_INBOX_outbox-relay"] {
        assert!(
            load("", &[("OUTBOX_RELAY_NATS_INBOX_PREFIX", good)]).is_ok(),
            "{good}"
        );
    }
}

#[test]
fn event_source_and_format_keys() {
    let c = load(
        "",
        &[
            (
                "OUTBOX_RELAY_OUTBOX_HEADER_COLUMNS",
                "tenant_id, region:X-Region",
            ),
            ("OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX", "outbox"),
            ("OUTBOX_RELAY_NATS_CLOUDEVENTS", "true"),
        ],
    )
    .unwrap();
    assert_eq!(
        c.config().outbox.header_column_pairs(),
        [
            ("tenant_id".to_owned(), "tenant_id".to_owned()),
            ("region".to_owned(), "X-Region".to_owned())
        ]
    );
    assert_eq!(c.config().outbox.message_prefix, "outbox");
    assert!(c.config().nats.cloudevents);
    assert_eq!(c.config().nats.cloudevents_source, "outbox-relay");
    // Messages only needs a prefix.
    let c = load("[outbox]\ntable = \"\"\nmessage_prefix = \"outbox\"\n", &[]).unwrap();
    assert!(c.config().outbox.messages_only());
    let e = load("[outbox]\ntable = \"\"\nmessage_prefix = \"\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("outbox.message_prefix"), "{e}");
    for (bad, why) in [
        ("[\"msg_id:nats-msg-id\"]", "reserved"),
        ("[\"t:Outbox-Tenant\"]", "reserved"),
        ("[\"t:a b\"]", "not a valid header name"),
        ("[\"drop table\"]", "plain identifier"),
        ("[\"a:X\", \"b:x\"]", "twice"),
    ] {
        let e = load(&format!("[outbox]\nheader_columns = {bad}\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(why) && e.contains("OUTBOX_RELAY_OUTBOX_HEADER_COLUMNS"),
            "{bad}: {e}"
        );
    }
    // ce-* is an ordinary name until CloudEvents are on.
    assert!(load("[outbox]\nheader_columns = [\"t:ce-tenant\"]\n", &[]).is_ok());
    let e = load(
        "[outbox]\nheader_columns = [\"t:ce-tenant\"]\n[nats]\ncloudevents = true\n",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("reserved"), "{e}");
}

#[test]
fn telemetry_and_context_keys() {
    let c = load("", &[]).unwrap();
    assert_eq!(c.config().telemetry.otlp_endpoint, "", "off by default");
    assert_eq!(c.config().telemetry.service_name, "outbox-relay");
    assert_eq!(c.config().outbox.context_prefix, "");
    let c = load(
        "[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318\"\n",
        &[("OUTBOX_RELAY_OUTBOX_CONTEXT_PREFIX", "outbox-context")],
    )
    .unwrap();
    assert_eq!(c.config().outbox.context_prefix, "outbox-context");
    assert_eq!(
        crate::telemetry::traces_url(&c.config().telemetry.otlp_endpoint).unwrap(),
        "http://127.0.0.1:4318/v1/traces"
    );
    assert_eq!(
        crate::telemetry::traces_url("http://collector:4318/custom/path").unwrap(),
        "http://collector:4318/custom/path"
    );
    for (bad, why) in [
        ("https://collector:4318", "not supported"),
        ("collector:4318", "not supported"),
        ("not a url", "not a URL"),
        ("http://user:pw@collector:4318", "credentials"),
    ] {
        let e = load("", &[("OUTBOX_RELAY_TELEMETRY_OTLP_ENDPOINT", bad)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("telemetry.otlp_endpoint") && e.contains(why),
            "{bad}: {e}"
        );
    }
    let e = load(
        "[outbox]\nmessage_prefix = \"outbox\"\ncontext_prefix = \"outbox\"\n",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("outbox.context_prefix"), "{e}");
}

#[test]
fn toml_errors_never_echo_the_source_line() {
    let e = load(
        "[postgres]
url = \"postgres://u:hunter2@h/d
",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(!e.contains("hunter2"), "{e}");
    assert!(e.contains("line 2"), "{e}");
}

#[test]
fn log_level_words_must_be_levels_or_targets() {
    for good in [
        "info",
        "warn,outbox_relay=debug",
        "outbox_relay",
        "async_nats=trace",
        "DEBUG",
    ] {
        assert!(
            load(&format!("[log]\nlevel = \"{good}\"\n"), &[]).is_ok(),
            "{good}"
        );
    }
    for bad in ["loud", "info,outbox_relay=loud", "verbose"] {
        let e = load(&format!("[log]\nlevel = \"{bad}\"\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("log.level"), "{bad}: {e}");
    }
}

#[test]
fn invalid_values_name_key_and_env() {
    let e = load("[postgres]\nslot = \"Bad-Slot\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("postgres.slot") && e.contains("OUTBOX_RELAY_POSTGRES_SLOT"),
        "{e}"
    );
    let e = load("[outbox]\ntable = \"outbox\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("schema-qualified"), "{e}");
    let e = load("[nats]\nsubject = \"outbox.{bogus}\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("nats.subject") && e.contains("bogus"), "{e}");
    let e = load("", &[("OUTBOX_RELAY_NATS_MAX_IN_FLIGHT", "lots")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("whole number"), "{e}");
    let e = load("[nats]\ndead_letter_subject = \"outbox.dead\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("matched by nats.subject"), "{e}");
    let e = load("[postgres]\nurl = \"mysql://x\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("postgres.url"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
}

#[test]
fn bad_toml_names_the_file() {
    let e = load("[postgres\n", &[]).unwrap_err().to_string();
    assert!(e.starts_with("config file "), "{e}");
    assert!(!e.contains('\n'), "{e}");
}

#[test]
fn debug_hides_passwords() {
    let c = load(
        "[postgres]\nurl = \"postgres://u:hunter2@h/d\"\n[nats]\nurl = \"nats://a:s3cret@h:4222\"\n",
        &[],
    )
    .unwrap();
    let d = format!("{c:?}");
    assert!(!d.contains("hunter2") && !d.contains("s3cret"), "{d}");
}

#[test]
fn a_schema_directory_that_does_not_load_is_a_config_error_for_the_commands_that_check() {
    let e = load("[outbox]\nschemas_required = true\n", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("outbox.schemas_required"), "{e}");
    // Loads (status reports it), but refuses where events are checked.
    let s = load("", &[("OUTBOX_RELAY_OUTBOX_SCHEMAS", "/no/such/schemas")]).unwrap();
    let e = s.schemas_loaded().unwrap_err().to_string();
    assert!(
        e.contains("outbox.schemas")
            && e.contains("OUTBOX_RELAY_OUTBOX_SCHEMAS")
            && e.contains("/no/such/schemas: cannot read the directory"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
    assert!(load("", &[]).unwrap().schemas_loaded().is_ok());
}

#[test]
fn atomic_group_ms_is_bounded_in_one_line() {
    assert_eq!(
        load("", &[]).unwrap().config().nats.atomic_group_ms,
        1,
        "group commit is on by default"
    );
    for ok in ["0", "1000"] {
        let c = load("", &[("OUTBOX_RELAY_NATS_ATOMIC_GROUP_MS", ok)]).unwrap();
        assert_eq!(c.config().nats.atomic_group_ms.to_string(), ok);
    }
    let e = load("[nats]\natomic_group_ms = 1001\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("config nats.atomic_group_ms (env OUTBOX_RELAY_NATS_ATOMIC_GROUP_MS): ")
            && e.contains("must be at most 1000"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
}

#[test]
fn park_mode_has_its_keys_and_variables_and_needs_the_fence() {
    let d = Config::load_with_env(None, Vec::new()).unwrap();
    assert_eq!(
        d.config().outbox.on_invalid,
        OnInvalid::DeadLetter,
        "the default stays"
    );
    assert_eq!(d.config().outbox.park_key, ParkKey::Aggregate);
    assert_eq!(d.config().outbox.max_parked_keys, 10_000);
    assert!(!d.park_on_invalid);
    let c = load(
        "[outbox]\non_invalid = \"park\"\npark_key = \"aggregate\"\nmax_parked_keys = 3\n",
        &[],
    )
    .unwrap();
    assert!(c.park_on_invalid && !c.stop_on_invalid);
    assert_eq!(c.config().outbox.max_parked_keys, 3);
    let c = load(
        "",
        &[
            ("OUTBOX_RELAY_OUTBOX_ON_INVALID", "park"),
            ("OUTBOX_RELAY_OUTBOX_PARK_KEY", "aggregate"),
            ("OUTBOX_RELAY_OUTBOX_MAX_PARKED_KEYS", "1000000"),
        ],
    )
    .unwrap();
    assert!(c.park_on_invalid);
    assert_eq!(c.config().outbox.max_parked_keys, 1_000_000);
    for bad in ["0", "1000001"] {
        let e = load("", &[("OUTBOX_RELAY_OUTBOX_MAX_PARKED_KEYS", bad)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_parked_keys") && !e.contains('\n'), "{e}");
    }
    let e = load("[outbox]\npark_key = \"event\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("park_key"), "{e}");
    let e = load(
        "[outbox]\non_invalid = \"park\"\n[nats]\nfence = false\n",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("outbox.on_invalid") && e.contains("nats.fence") && !e.contains('\n'),
        "{e}"
    );
}

#[test]
fn park_with_atomic_transactions_is_refused_in_one_line_naming_both_and_the_way_out() {
    for env in [
        &[][..],
        &[
            ("OUTBOX_RELAY_OUTBOX_ON_INVALID", "park"),
            ("OUTBOX_RELAY_NATS_ATOMIC_TRANSACTIONS", "true"),
        ][..],
    ] {
        let file = if env.is_empty() {
            "[outbox]\non_invalid = \"park\"\n[nats]\natomic_transactions = true\n"
        } else {
            ""
        };
        let e = load(file, env).unwrap_err().to_string();
        for part in [
            "outbox.on_invalid",
            "OUTBOX_RELAY_OUTBOX_ON_INVALID",
            "nats.atomic_transactions = true",
            "split the transaction",
            "set nats.atomic_transactions = false to park keys",
            "outbox.on_invalid = \"dead_letter\"",
        ] {
            assert!(e.contains(part), "{part:?} not in {e}");
        }
        assert!(!e.contains('\n'), "{e}");
    }
}
