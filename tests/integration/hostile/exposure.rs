//! What the repository's own deployment file offers the network (docs/security.md, security round
//! 5, finding 9): docker-compose.yml runs a demo with the password postgres/postgres, a NATS without
//! authentication, its monitoring port and the relay's unauthenticated listener, and Docker's port
//! rules bypass host firewalls. Every port it publishes must be bound to 127.0.0.1.

/// Every `ports:` entry of docker-compose.yml, as written.
fn published_ports(compose: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_ports = None;
    for line in compose.lines() {
        let indent = line.len() - line.trim_start().len();
        let text = line.trim();
        if text.starts_with('#') || text.is_empty() {
            continue;
        }
        if text == "ports:" {
            in_ports = Some(indent);
            continue;
        }
        match (in_ports, text.strip_prefix("- ")) {
            (Some(at), Some(entry)) if indent > at => {
                out.push(entry.trim_matches('"').to_owned());
            }
            _ => in_ports = None,
        }
    }
    out
}

/// Each published port of docker-compose.yml names 127.0.0.1 as its host address; the file says how
/// to open one on purpose.
#[test]
fn docker_compose_publishes_every_port_on_loopback_only() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docker-compose.yml");
    let compose = std::fs::read_to_string(path).expect("read docker-compose.yml");
    let ports = published_ports(&compose);
    assert!(
        ports.len() >= 4,
        "Postgres, NATS, its monitoring port and the relay are published: {ports:?}"
    );
    for p in &ports {
        assert!(
            p.starts_with("127.0.0.1:") && p.matches(':').count() == 2,
            "docker-compose.yml publishes {p:?} beyond loopback"
        );
    }
    assert!(
        compose.contains("To open one on purpose"),
        "docker-compose.yml says how to open a port on purpose"
    );
}
