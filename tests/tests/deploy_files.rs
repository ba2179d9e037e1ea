//! The deployment files are valid offline (issue 13): `deploy/validate.sh` checks the Kubernetes
//! manifests against the Kubernetes and KEDA schemas, the Containerfile with hadolint, the
//! systemd units with `systemd-analyze verify`, the alert rules and dashboard with promtool, and
//! the HAProxy config with `haproxy -c` (each check described in the script). Under `CI=true` a
//! missing tool fails; elsewhere its check is skipped with a warning.

use std::process::Command;

#[test]
fn deployment_files_pass_their_offline_validators() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/validate.sh");
    let out = Command::new("bash").arg(&script).output().expect("running deploy/validate.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(out.status.success(), "deploy/validate.sh failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("PASS Kubernetes 1.37.0 schemas"), "{stdout}");
}
