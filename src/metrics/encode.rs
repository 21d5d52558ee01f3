//! The Prometheus text format 0.0.4 (<https://prometheus.io/docs/instrumenting/exposition_formats/>):
//! the one writer of `/metrics`, so the `# HELP` and `# TYPE` lines, the sample lines and the
//! escaping of label values are spelled in one place for every series, the schema series included.

use std::fmt::{Display, Write as _};

use super::value::{BUCKETS, Histogram};

/// The type of a metric family, as its `# TYPE` line names it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    /// Only grows; the name ends in `_total`.
    Counter,
    /// Set to what was last measured.
    Gauge,
    /// Cumulative buckets, a sum and a count.
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// The labels of one sample, as (name, value) pairs in the order written; values are escaped here.
pub(crate) type Labels<'a> = &'a [(&'a str, &'a str)];

/// Appends a family's `# HELP` and `# TYPE` lines.
pub(crate) fn header(out: &mut String, name: &str, kind: Kind, help: &str) {
    let _ = write!(out, "# HELP {name} ");
    // The format escapes backslash and line feed in help text (quotes stay).
    for c in help.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    let _ = writeln!(out, "\n# TYPE {name} {}", kind.as_str());
}

/// Appends one sample line: `name{label="value",…} value`, without braces when there are no labels.
/// `name` is a `Display` so a histogram can write its `_bucket`, `_sum` and `_count` suffixes
/// without building a string.
pub(crate) fn sample(
    out: &mut String,
    name: impl Display,
    labels: Labels<'_>,
    value: impl Display,
) {
    let _ = write!(out, "{name}");
    for (i, (label, v)) in labels.iter().enumerate() {
        out.push(if i == 0 { '{' } else { ',' });
        let _ = write!(out, "{label}=\"");
        escape_label(out, v);
        out.push('"');
    }
    if !labels.is_empty() {
        out.push('}');
    }
    let _ = writeln!(out, " {value}");
}

/// Appends a whole family whose samples are known up front: its header, then one line per sample.
pub(crate) fn family(
    out: &mut String,
    name: &str,
    kind: Kind,
    help: &str,
    samples: &[(Labels<'_>, f64)],
) {
    header(out, name, kind, help);
    for (labels, v) in samples {
        sample(&mut *out, name, labels, v);
    }
}

/// Appends a histogram family: a cumulative line per bucket, `+Inf` (every observation), the sum
/// in seconds and the count.
pub(crate) fn histogram(out: &mut String, name: &str, help: &str, h: &Histogram) {
    header(out, name, Kind::Histogram, help);
    let mut cumulative = 0;
    for (b, n) in BUCKETS.iter().zip(h.bucket_counts()) {
        cumulative += n;
        let le = b.to_string();
        sample(
            &mut *out,
            format_args!("{name}_bucket"),
            &[("le", &le)],
            cumulative,
        );
    }
    let count = h.count();
    sample(
        &mut *out,
        format_args!("{name}_bucket"),
        &[("le", "+Inf")],
        count,
    );
    sample(&mut *out, format_args!("{name}_sum"), &[], h.sum_seconds());
    sample(out, format_args!("{name}_count"), &[], count);
}

/// A label value as the format wants it: backslash, double quote and line feed escaped.
fn escape_label(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}
