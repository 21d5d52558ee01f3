//! Text helpers for what the relay writes into one-line places (a header value, a log field, an
//! error line): line breaks out, and a length cut on a character boundary ([`cut`]; [`shortened`]
//! where the reader must see that something the relay wrote was cut; [`shown`] for text the relay
//! did not write, escaped as well). A leaf: it imports nothing of the crate, so any module may use
//! it.

use std::borrow::Cow;

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

/// `s` for a message: [`cut`] to at most `max` bytes, with `...` after it when it was cut.
pub(crate) fn shortened(s: &str, max: usize) -> Cow<'_, str> {
    let kept = cut(s, max);
    if kept.len() == s.len() {
        Cow::Borrowed(s)
    } else {
        Cow::Owned(format!("{kept}..."))
    }
}

/// `s` as one line a terminal shows as text, at most `max` bytes of it: what a server, a listener
/// or stream metadata said, which the relay prints but did not write. Control characters (line
/// breaks, `ESC` and the C1 controls a terminal acts on) and the bidirectional overrides that
/// reorder what is shown become `\u{..}` escapes, so nothing in it can start a line of its own,
/// move the cursor or hide text; past `max` bytes it is cut and ends in `…`.
pub(crate) fn shown(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max) + 3);
    for c in s.chars() {
        let escaped =
            c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        let len = out.len();
        if escaped {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
        if out.len() > max {
            out.truncate(len);
            out.push('…');
            break;
        }
    }
    out
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

    #[test]
    fn shortened_says_it_was_cut() {
        assert_eq!(shortened("abc", 3), "abc");
        assert!(matches!(shortened("abc", 3), Cow::Borrowed(_)));
        assert_eq!(shortened("abcd", 3), "abc...");
        assert_eq!(shortened("aüb", 2), "a...");
    }

    #[test]
    fn shown_escapes_what_a_terminal_would_act_on_and_cuts() {
        assert_eq!(shown("plain text", 100), "plain text");
        assert_eq!(
            shown("0/1\nrelay: streaming\x1b[2K\u{9b}x", 100),
            "0/1\\u{a}relay: streaming\\u{1b}[2K\\u{9b}x"
        );
        assert_eq!(shown("a\u{202e}b", 100), "a\\u{202e}b");
        assert_eq!(shown("abcdef", 3), "abc…");
        assert_eq!(shown("ab\ncd", 3), "ab…", "an escape is never cut in half");
    }
}
