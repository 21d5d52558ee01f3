//! Reading a file that holds a secret (the Postgres password file, a NATS NKey seed or creds file):
//! it must be a regular file, and no one but its owner may read it. Two rules from libpq: a key file
//! may be mode 0600 or less, or 0640 or less when owned by root (so a service group can be given
//! access); the password file must be 0600 or less, whoever owns it.
//!
//! The check and the read use the same open file: checking a path and then opening it again would
//! check one file and read another if it were swapped in between. The file is opened non-blocking,
//! so a FIFO or a device in its place (even one swapped in at the last moment) is refused after an
//! open that returns at once: a plain open of a FIFO blocks until someone writes to it.

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
    read_with(path, access, || {})
}

/// [`read`], with `before_open` run just before the file is opened: the tests swap a FIFO in there.
fn read_with(
    path: &Path,
    access: Access,
    before_open: impl FnOnce(),
) -> Result<String, SecretFileError> {
    let shown = || path.display().to_string();
    let io = |error| SecretFileError::Io {
        path: shown(),
        error,
    };
    before_open();
    // Non-blocking: whatever is at the path now (a FIFO swapped in after a look would block a plain
    // open until someone writes to it), the open returns at once, and the open file is what is
    // checked and read. A regular file reads the same either way.
    let mut file = open_nonblocking(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(SecretFileError::NotRegular(shown()));
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
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

#[cfg(not(unix))]
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    File::open(path)
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

    /// docs/security.md, finding 9: a regular file that is replaced by a FIFO just before it is
    /// opened (after any look at the path) is refused at once, not waited on: the open does not
    /// block. Run on a thread, so a blocking open fails the test after 10 s instead of hanging it.
    #[test]
    fn a_fifo_swapped_in_before_the_open_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let path = file(dir.path(), 0o600);
        let (done, finished) = std::sync::mpsc::channel();
        let swapped = path.clone();
        std::thread::spawn(move || {
            let r = read_with(&swapped, Access::Owner, || {
                std::fs::remove_file(&swapped).unwrap();
                let status = std::process::Command::new("mkfifo")
                    .arg(&swapped)
                    .status()
                    .unwrap();
                assert!(status.success());
            });
            let _ = done.send(r.map_err(|e| e.to_string()));
        });
        let r = finished
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("read blocked on the FIFO: no answer within 10 s");
        let e = r.unwrap_err();
        assert!(e.contains("is not a regular file"), "{e}");
        // Unblock a reader that is stuck (only before the fix): a writer opens the FIFO, itself
        // non-blocking (with no reader left, that open fails at once).
        use std::os::unix::fs::OpenOptionsExt;
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path);
    }
}
