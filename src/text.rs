//! Text helpers for what the relay writes into one-line places (a header value, a log field, an
//! error line): line breaks out, and a length cut on a character boundary. A leaf: it imports
//! nothing of the crate, so any module may use it.

/// `s` with its line breaks (and the blanks around them) turned into single spaces. Blanks within
/// a line stay as they are.
pub(crate) fn one_line(s: &str) -> String {
    s.split(['\r', '\n'])
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// `s` with every run of whitespace (line breaks included) turned into one space: for a parser's
/// message, whose own layout means nothing on one line.
pub(crate) fn single_spaced(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `s` cut to at most `max` bytes, on a character boundary.
pub(crate) fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_joins_lines_and_keeps_blanks_within_a_line() {
        assert_eq!(one_line("a  b\r\n  c\n\nd "), "a  b c d");
        assert_eq!(single_spaced("a  b\r\n  c\n\nd "), "a b c d");
    }

    #[test]
    fn cut_stays_on_a_character_boundary() {
        assert_eq!(cut("abc", 5), "abc");
        assert_eq!(cut("abc", 2), "ab");
        assert_eq!(cut("aü", 2), "a");
    }
}
