//! An event's own headers given as a JSON object (the headers column, a logical message's
//! `"headers"`): each name checked ([`crate::header_name`]), each value one line.

/// The headers column: a JSON object; string values as they are, other values as their JSON text.
/// Names must be valid header names and must not override the relay's own headers.
pub(super) fn parse_headers(
    json: &str,
    cloudevents: bool,
) -> Result<Vec<(String, String)>, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("not JSON ({e})"))?;
    let serde_json::Value::Object(map) = value else {
        return Err("not a JSON object".into());
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        crate::header_name::check(&k, cloudevents)?;
        let v = match v {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        };
        if v.contains(['\r', '\n']) {
            return Err(format!("the value of {k:?} contains a line break"));
        }
        out.push((k, v));
    }
    Ok(out)
}
