//! Schema helpers for fields whose full Kubernetes schema would bloat the CRD.

use schemars::{Schema, SchemaGenerator, json_schema};

/// An object the apiserver keeps as given (`x-kubernetes-preserve-unknown-fields`).
pub fn preserve_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true })
}

/// A list of objects the apiserver keeps as given.
pub fn preserve_list(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "items": { "type": "object", "x-kubernetes-preserve-unknown-fields": true }
    })
}
