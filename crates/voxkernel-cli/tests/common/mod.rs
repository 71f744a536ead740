//! Helpers shared by the CLI's process tests.

use std::process::Output;

/// The standard output of a process that must have succeeded; otherwise fails the test with
/// both of its outputs.
pub fn stdout_of_success(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}
