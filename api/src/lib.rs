//! rlplane's API: the `RLJob` custom resource, its validation, the model manifests, and the
//! operator→worker wiring contract ([`plan::WorkerPlan`]) with the pure code that builds it
//! ([`topology::build_plan`]).

pub mod manifest;
pub mod model;
pub mod plan;
pub mod schema;
pub mod spec;
pub mod topology;
pub mod validate;

pub use manifest::{ManifestErrors, load_rljob};
pub use model::{DType, ModelPreset, TensorSpec, TpSplit};
pub use plan::{WorkerPlan, job_token};
pub use spec::*;
pub use validate::{FieldError, ValidationErrors, validate, validate_job};
