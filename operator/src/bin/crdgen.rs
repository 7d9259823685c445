//! Writes the RLJob CustomResourceDefinition as YAML (to stdout, or to the path given).
//! `crds/rljob.yaml` is generated with it; CI fails when the committed file is stale.

use kube::CustomResourceExt;

fn main() -> std::process::ExitCode {
    let yaml = match rlplane_operator::crd_yaml() {
        Ok(y) => y,
        Err(e) => {
            eprintln!("error: cannot render the CRD: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let _ = rlplane_api::RLJob::crd_name();
    match std::env::args().nth(1) {
        Some(path) => {
            if let Err(e) = std::fs::write(&path, yaml) {
                eprintln!("error: cannot write {path}: {e}");
                return std::process::ExitCode::FAILURE;
            }
        }
        None => print!("{yaml}"),
    }
    std::process::ExitCode::SUCCESS
}
