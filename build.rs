//! Build script: names the commit the binary was built from, for `outbox-relay --version`
//! (`0.1.0 (commit 1a2b3c4d5e6f)`). From `OUTBOX_RELAY_COMMIT` when a packager sets it (a build
//! without the repository's history, such as the Docker image's), else from `git`, else `unknown`.
//! Uncommitted changes are not tracked: the commit is the one they were made on.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn main() {
    println!("cargo:rerun-if-env-changed=OUTBOX_RELAY_COMMIT");
    let commit = match std::env::var("OUTBOX_RELAY_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_owned(),
        _ => match git(&["rev-parse", "--short=12", "HEAD"]) {
            Some(c) => {
                // Rebuild when HEAD moves (a commit, a checkout). Paths come from `--git-path`, which
                // knows a worktree's layout (its HEAD is its own, branches live in the common
                // directory). Only existing paths are named: cargo reruns a build script on every
                // build while a named path is missing, and `packed-refs` often is. The branch
                // directory is watched as a whole, so a branch ref written later is still seen.
                let paths = ["HEAD", "refs/heads", "packed-refs"];
                for path in paths {
                    let Some(p) = git(&["rev-parse", "--path-format=absolute", "--git-path", path])
                    else {
                        continue;
                    };
                    if std::path::Path::new(&p).exists() {
                        println!("cargo:rerun-if-changed={p}");
                    }
                }
                c
            }
            None => "unknown".to_owned(),
        },
    };
    println!("cargo:rustc-env=OUTBOX_RELAY_COMMIT={commit}");
}
