//! Loading an RLJob manifest from YAML for the local runner and the CLI: parse, refuse unknown
//! fields (the apiserver would silently prune a misspelt field; we name it and suggest the right
//! one), deserialize, then [`crate::validate_job`]. Every problem is reported at once.

use kube::CustomResourceExt;
use serde_json::Value;

use crate::spec::RLJob;

/// Everything wrong with a manifest, one line per problem.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.join("\n"))]
pub struct ManifestErrors(pub Vec<String>);

/// Parses and validates an RLJob manifest.
pub fn load_rljob(text: &str) -> Result<RLJob, ManifestErrors> {
    let value: Value =
        serde_saphyr::from_str(text).map_err(|e| ManifestErrors(vec![format!("not valid YAML: {e}")]))?;
    let mut errors = Vec::new();
    match (value.get("apiVersion").and_then(Value::as_str), value.get("kind").and_then(Value::as_str)) {
        (Some("rlplane.dev/v1alpha1"), Some("RLJob")) => {}
        (api, kind) => errors.push(format!(
            "apiVersion/kind: found {}/{}; an RLJob manifest starts with `apiVersion: rlplane.dev/v1alpha1` and `kind: RLJob`",
            api.unwrap_or("<none>"),
            kind.unwrap_or("<none>")
        )),
    }
    let schema = crd_schema();
    if let Some(spec) = value.get("spec") {
        unknown_fields(spec, &schema["properties"]["spec"], "spec", &mut errors);
    } else {
        errors.push("spec: missing; an RLJob needs a spec (see manifests/rljob-cpu.yaml)".into());
    }
    if !errors.is_empty() {
        return Err(ManifestErrors(errors));
    }
    let job: RLJob = serde_json::from_value(value).map_err(|e| ManifestErrors(vec![format!("spec: {e}")]))?;
    crate::validate_job(&job).map_err(|e| ManifestErrors(e.lines()))?;
    Ok(job)
}

/// The CRD's openAPIV3 schema as JSON.
pub fn crd_schema() -> Value {
    let crd = RLJob::crd();
    let schema = crd.spec.versions[0].schema.as_ref().and_then(|s| s.open_api_v3_schema.as_ref()).cloned();
    serde_json::to_value(schema).unwrap_or(Value::Null)
}

/// Reports fields of `value` that `schema` does not declare.
fn unknown_fields(value: &Value, schema: &Value, path: &str, errors: &mut Vec<String>) {
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) {
        return;
    }
    match value {
        Value::Object(map) => {
            if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                for (k, v) in map {
                    match props.get(k) {
                        Some(s) => unknown_fields(v, s, &format!("{path}.{k}"), errors),
                        None => {
                            let hint = closest(k, props.keys().map(String::as_str))
                                .map(|c| format!("; did you mean `{c}`?"))
                                .unwrap_or_else(|| {
                                    let mut known: Vec<_> = props.keys().map(String::as_str).collect();
                                    known.sort();
                                    format!("; known fields: {}", known.join(", "))
                                });
                            errors.push(format!("{path}.{k}: unknown field{hint}"));
                        }
                    }
                }
            } else if let Some(ap) = schema.get("additionalProperties").filter(|s| s.is_object()) {
                for (k, v) in map {
                    unknown_fields(v, ap, &format!("{path}.{k}"), errors);
                }
            }
        }
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                for (i, v) in items.iter().enumerate() {
                    unknown_fields(v, s, &format!("{path}[{i}]"), errors);
                }
            }
        }
        _ => {
            // A value outside an enum (e.g. `refit.verify: Everything`): name the field and the
            // values it takes, instead of serde's path-less "unknown variant".
            if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
                && !allowed.contains(value)
            {
                let names: Vec<String> =
                    allowed.iter().map(|a| a.as_str().map_or_else(|| a.to_string(), String::from)).collect();
                let hint = value
                    .as_str()
                    .and_then(|v| closest(v, names.iter().map(String::as_str)))
                    .map(|c| format!("; did you mean `{c}`?"))
                    .unwrap_or_default();
                errors.push(format!("{path}: {value} is not one of {}{hint}", names.join(", ")));
            }
        }
    }
}

/// The known name nearest to `name` by edit distance, if it is near enough to be a typo.
fn closest<'a>(name: &str, known: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    known
        .map(|k| (edit_distance(&name.to_lowercase(), &k.to_lowercase()), k))
        .filter(|(d, k)| *d <= 2.max(k.len() / 4))
        .min()
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "apiVersion: rlplane.dev/v1alpha1\nkind: RLJob\nmetadata: {name: t}\nspec:\n  mode: Split\n  device: Cpu\n  model: {preset: tiny}\n  trainer: {gpusPerNode: 1}\n  generation: {engines: 1}\n";

    #[test]
    fn a_good_manifest_loads_with_defaults() {
        let job = load_rljob(GOOD).unwrap();
        assert_eq!(job.spec.refit.num_buffers, 2);
        assert_eq!(job.spec.workload.steps, 3);
    }

    #[test]
    fn a_misspelt_field_is_named_with_a_suggestion() {
        let bad = GOOD.replace("trainer:", "trainr:");
        let e = load_rljob(&bad).unwrap_err().to_string();
        assert!(e.contains("spec.trainr: unknown field; did you mean `trainer`?"), "{e}");
        let nested = GOOD.replace("gpusPerNode", "gpuPerNode");
        let e = load_rljob(&nested).unwrap_err().to_string();
        assert!(e.contains("spec.trainer.gpuPerNode: unknown field; did you mean `gpusPerNode`?"), "{e}");
    }

    #[test]
    fn wrong_kind_and_bad_yaml_are_refused() {
        let e = load_rljob(&GOOD.replace("kind: RLJob", "kind: Job")).unwrap_err().to_string();
        assert!(e.contains("kind: RLJob"), "{e}");
        let e = load_rljob("spec: [unclosed").unwrap_err().to_string();
        assert!(e.starts_with("not valid YAML"), "{e}");
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
    }
}
