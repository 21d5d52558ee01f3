//! libpq's password file (`~/.pgpass`, or `PGPASSFILE`): `hostname:port:database:username:password`
//! lines, `*` matching anything, `\:` and `\\` escaped, the first matching line wins
//! (<https://www.postgresql.org/docs/current/libpq-pgpass.html>). Like libpq, a file that group or
//! others can read is ignored, with a warning; so is one that is not a regular file.

use std::io::ErrorKind;
use std::path::Path;

use tracing::warn;

use crate::secret_file::{self, Access, SecretFileError};

/// The password for this host, port, database and user, if the file has one. A missing file is no
/// password; one that group or others can read, or that is not a regular file, is ignored with a
/// warning (libpq ignores the first; a FIFO in its place would block the relay).
pub(super) fn lookup(
    file: &Path,
    host: &str,
    port: u16,
    dbname: &str,
    user: &str,
) -> Option<String> {
    let text = match secret_file::read(file, Access::Owner) {
        Ok(text) => text,
        Err(SecretFileError::Io { error, .. }) if error.kind() == ErrorKind::NotFound => {
            return None;
        }
        Err(e) => {
            warn!(file = %file.display(), "password file ignored: {e}");
            return None;
        }
    };
    find(&text, host, port, dbname, user)
}

/// The first matching line's password.
fn find(text: &str, host: &str, port: u16, dbname: &str, user: &str) -> Option<String> {
    let port = port.to_string();
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(fields)
        .find(|f| {
            f.len() == 5
                && [host, port.as_str(), dbname, user]
                    .iter()
                    .zip(f)
                    .all(|(want, field)| field == "*" || field == want)
        })
        .map(|mut f| f.swap_remove(4))
}

/// Splits one line at unescaped colons, unescaping `\:` and `\\`.
fn fields(line: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let (Some(n), Some(s)) = (chars.next(), out.last_mut()) {
                    s.push(n);
                }
            }
            ':' if out.len() < 5 => out.push(String::new()),
            c => {
                if let Some(s) = out.last_mut() {
                    s.push(c)
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_matching_line_wins_with_wildcards_and_escapes() {
        let text = "# comment\n\
                    db1:5432:app:relay:first\n\
                    *:*:app:relay:p\\:w\\\\d\n\
                    *:*:*:*:fallback\n";
        assert_eq!(
            find(text, "db1", 5432, "app", "relay").as_deref(),
            Some("first")
        );
        assert_eq!(
            find(text, "db2", 5432, "app", "relay").as_deref(),
            Some("p:w\\d")
        );
        assert_eq!(
            find(text, "db2", 5432, "other", "x").as_deref(),
            Some("fallback")
        );
        assert_eq!(
            find("db1:5432:app:relay:x\n", "db1", 5433, "app", "relay"),
            None
        );
    }

    #[test]
    fn a_file_others_can_read_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pgpass");
        std::fs::write(&path, "*:*:*:*:secret\n").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
            assert_eq!(lookup(&path, "h", 5432, "d", "u"), None);
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        assert_eq!(
            lookup(&path, "h", 5432, "d", "u").as_deref(),
            Some("secret")
        );
    }
}
