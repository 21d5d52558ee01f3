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
                // Rebuild when HEAD moves (a commit, a checkout): HEAD and the branch it names.
                if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
                    println!("cargo:rerun-if-changed={dir}/HEAD");
                    if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
                        println!("cargo:rerun-if-changed={dir}/{reference}");
                    }
                    println!("cargo:rerun-if-changed={dir}/packed-refs");
                }
                c
            }
            None => "unknown".to_owned(),
        },
    };
    println!("cargo:rustc-env=OUTBOX_RELAY_COMMIT={commit}");
}
