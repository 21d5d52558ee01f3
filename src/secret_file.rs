//! Reading a file that holds a secret (the Postgres password file, a NATS NKey seed or creds file):
//! it must be a regular file, and no one but its owner may read it. Two rules from libpq: a key file
//! may be mode 0600 or less, or 0640 or less when owned by root (so a service group can be given
//! access); the password file must be 0600 or less, whoever owns it.
//!
//! The check and the read use the same open file: checking a path and then opening it again would
//! check one file and read another if it were swapped in between. A FIFO or a device in the file's
//! place is refused before it is opened, because opening a FIFO blocks until someone writes to it.

use std::fs::File;
use std::io::Read;
use std::path::Path;

/// Why a secret file cannot be used; the text says what to do.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SecretFileError {
    /// It cannot be opened or read (the OS error shown, the way every caller reports it: as text).
    #[error("cannot read {path}: {error}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        error: std::io::Error,
    },
    /// It is a directory, FIFO, socket or device.
    #[error("{0} is not a regular file")]
    NotRegular(String),
    /// Group or others can read or write it.
    #[error("{path} has group or world access (mode {mode:04o}): chmod 0600 it")]
    Exposed {
        /// The file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// It was replaced between the check and the open.
    #[error("{0} changed while it was being opened: try again")]
    Replaced(String),
}

/// Who besides the owner may read a secret file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// The owner only (libpq's password file).
    Owner,
    /// The owner, and its group when root owns the file (libpq's private keys).
    RootGroup,
}

/// The file's text, after checking that it is a regular file readable as `access` allows.
pub(crate) fn read(path: &Path, access: Access) -> Result<String, SecretFileError> {
    let shown = || path.display().to_string();
    let io = |error| SecretFileError::Io {
        path: shown(),
        error,
    };
    let before = std::fs::metadata(path).map_err(io)?;
    if !before.is_file() {
        return Err(SecretFileError::NotRegular(shown()));
    }
    let mut file = File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !same_file(&before, &meta) || !meta.is_file() {
        return Err(SecretFileError::Replaced(shown()));
    }
    check_mode(&meta, access).map_err(|mode| SecretFileError::Exposed {
        path: shown(),
        mode,
    })?;
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(io)?;
    Ok(text)
}

#[cfg(unix)]
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

#[cfg(not(unix))]
fn same_file(_: &std::fs::Metadata, _: &std::fs::Metadata) -> bool {
    true
}

/// `Err(mode)` when group or others have access beyond libpq's rule.
#[cfg(unix)]
fn check_mode(meta: &std::fs::Metadata, access: Access) -> Result<(), u32> {
    use std::os::unix::fs::MetadataExt;
    let mode = meta.mode() & 0o7777;
    let allowed = match access {
        Access::RootGroup if meta.uid() == 0 => 0o640,
        _ => 0o600,
    };
    if mode & 0o777 & !allowed != 0 {
        return Err(mode);
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_mode(_: &std::fs::Metadata, _: Access) -> Result<(), u32> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn file(dir: &Path, mode: u32) -> std::path::PathBuf {
        let path = dir.join("secret");
        std::fs::write(&path, "s3cret\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn an_owner_only_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        for access in [Access::Owner, Access::RootGroup] {
            assert_eq!(read(&file(dir.path(), 0o600), access).unwrap(), "s3cret\n");
            assert_eq!(read(&file(dir.path(), 0o400), access).unwrap(), "s3cret\n");
        }
    }

    #[test]
    fn group_or_world_access_is_refused_naming_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        // Tests may run as root, where 0640 is allowed; 0644 and 0606 never are.
        for mode in [0o644, 0o606, 0o660] {
            let e = read(&file(dir.path(), mode), Access::RootGroup).unwrap_err();
            assert!(
                matches!(e, SecretFileError::Exposed { .. }),
                "{mode:o}: {e:?}"
            );
            assert!(e.to_string().contains("chmod 0600"), "{e}");
        }
        let e = read(&file(dir.path(), 0o640), Access::Owner).unwrap_err();
        assert!(matches!(e, SecretFileError::Exposed { .. }), "{e:?}");
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fifo");
        let status = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(status.success());
        let e = read(&path, Access::Owner).unwrap_err();
        assert!(matches!(e, SecretFileError::NotRegular(_)), "{e:?}");
        let e = read(dir.path(), Access::Owner).unwrap_err();
        assert!(matches!(e, SecretFileError::NotRegular(_)), "{e:?}");
    }
}
