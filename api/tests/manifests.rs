//! Every manifest in `manifests/` is accepted twice — by the generated CRD (its openAPI schema
//! through a JSON-schema validator, its CEL rules through kube-cel, as the apiserver would) and by
//! `validate()` — and every manifest in `manifests/invalid/` is rejected with the message its
//! header names. Header lines of an invalid manifest:
//!   `# expect: <text>`: `load_rljob` must fail with a message containing it;
//!   `# crd: rejects`: the CRD's schema or CEL rules must refuse it as well;
//!   `# crd: accepts`: only `validate()` can see the problem (it depends on a preset's tensors, or
//!     on label syntax inside a map, which a CEL rule could only check at a cost the apiserver's
//!     budget for unbounded maps refuses);
//!   `# crd: list-map`: the apiserver refuses it through `x-kubernetes-list-map-keys`, which no
//!     offline validator implements; the test checks the CRD declares that key;
//!   `# crd: pruned`: the apiserver would prune the unknown field; `load_rljob` refuses it.

use std::path::{Path, PathBuf};

use rlplane_api::load_rljob;
use rlplane_api::manifest::crd_schema;
use serde_json::Value;

fn manifests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests")
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    v
}

/// Problems the CRD finds: openAPI schema violations and CEL rule failures.
fn crd_problems(object: &Value) -> Vec<String> {
    let schema = crd_schema();
    let mut problems: Vec<String> = Vec::new();
    let validator = jsonschema::validator_for(&schema).expect("the CRD schema is a valid JSON schema");
    problems.extend(validator.iter_errors(object).map(|e| format!("schema: {} at {}", e, e.instance_path)));
    if let Err(errs) = kube::core::cel::Validator::new().validate(&schema, object, None) {
        problems.extend(errs.into_vec().into_iter().map(|e| format!("cel: {e}")));
    }
    problems
}

fn header(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| l.strip_prefix(&format!("# {key}: ")).map(str::to_string))
}

#[test]
fn every_example_manifest_is_accepted_by_the_crd_and_by_validate() {
    let files = yaml_files(&manifests_dir());
    assert!(files.len() >= 4, "expected the example manifests, found {files:?}");
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let job = load_rljob(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(job.metadata.name.is_some());
        let raw: Value = serde_saphyr::from_str(&text).unwrap();
        let problems = crd_problems(&raw);
        assert!(problems.is_empty(), "{}: the CRD rejects it: {problems:#?}", f.display());
    }
}

#[test]
fn every_invalid_manifest_is_rejected_with_its_message() {
    let files = yaml_files(&manifests_dir().join("invalid"));
    assert!(files.len() >= 12, "at least 12 invalid manifests, found {}", files.len());
    let schema = crd_schema();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        let expect = header(&text, "expect").unwrap_or_else(|| panic!("{name}: no `# expect:` header"));
        let crd = header(&text, "crd").unwrap_or_else(|| panic!("{name}: no `# crd:` header"));
        let err = load_rljob(&text).expect_err(&format!("{name} must be rejected")).to_string();
        assert!(err.contains(&expect), "{name}: expected a message containing\n  {expect}\nbut got\n  {err}");
        // One rule each: exactly one problem reported.
        assert_eq!(err.lines().count(), 1, "{name} should break exactly one rule, got:\n{err}");

        let raw: Value = serde_saphyr::from_str(&text).unwrap();
        let problems = crd_problems(&raw);
        match crd.as_str() {
            "rejects" => assert!(!problems.is_empty(), "{name}: the CRD accepts it but should reject it"),
            "accepts" | "pruned" => {
                assert!(problems.is_empty(), "{name}: the CRD was expected to accept it: {problems:#?}")
            }
            "list-map" => {
                let tensors = &schema["properties"]["spec"]["properties"]["model"]["properties"]["tensors"];
                assert_eq!(tensors["x-kubernetes-list-type"], "map");
                assert_eq!(tensors["x-kubernetes-list-map-keys"], serde_json::json!(["name"]));
            }
            other => panic!("{name}: unknown `# crd: {other}`"),
        }
    }
}

#[test]
fn validate_reports_every_error_at_once() {
    let text = std::fs::read_to_string(manifests_dir().join("rljob-cpu.yaml")).unwrap();
    let bad =
        text.replace("numBuffers: 2", "numBuffers: 0").replace("min: 32", "min: 999").replace("data: 2}", "data: 5}");
    let err = load_rljob(&bad).unwrap_err().to_string();
    assert!(err.contains("spec.refit.numBuffers"), "{err}");
    assert!(err.contains("spec.workload.responseTokens"), "{err}");
    assert!(err.contains("spec.trainer.parallelism"), "{err}");
    assert!(err.lines().count() >= 3, "{err}");
}

#[test]
#[ignore = "diagnostic: prints what the CRD says about each invalid manifest"]
fn print_crd_verdicts() {
    for f in yaml_files(&manifests_dir().join("invalid")) {
        let text = std::fs::read_to_string(&f).unwrap();
        let raw: Value = serde_saphyr::from_str(&text).unwrap();
        println!("{}: {:?}", f.file_name().unwrap().to_string_lossy(), crd_problems(&raw));
    }
}
