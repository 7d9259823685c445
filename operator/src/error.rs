//! Errors of a reconcile. Spec problems are not errors here: they are decisions (Failed/InvalidSpec,
//! see [`crate::decide`]). What remains is transient (the API server refused or failed a call) or
//! the cluster lacking something the spec asks for; both are retried with backoff, surface as a
//! Warning Event, and, when they stop pods from being created, as PodsCreated=False/CreateFailed.

/// A reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("cannot {action} {what}: {source}")]
    Kube {
        /// What was attempted, e.g. `apply`.
        action: &'static str,
        /// The object, e.g. `Pod ml/grpo-trainer-0`.
        what: String,
        /// The client's error.
        #[source]
        source: Box<kube::Error>,
    },
    /// `scheduling.gang` names a scheduler whose PodGroup API the cluster does not serve.
    #[error(
        "spec.scheduling.gang is {gang}, but the cluster has no {api} PodGroup API; install {install}, or set spec.scheduling.gang to None"
    )]
    GangSchedulerMissing {
        /// `Volcano` or `Coscheduling`.
        gang: &'static str,
        /// The group/version of the PodGroup.
        api: &'static str,
        /// What to install.
        install: &'static str,
    },
    /// The RLJob lacks metadata only the API server sets (it was not read from one).
    #[error("the RLJob has no {0}; it must come from the API server")]
    MissingMetadata(&'static str),
    /// The operating system's random source failed (drawing an epoch's key).
    #[error("the system random source failed drawing {0}")]
    Random(&'static str),
}

impl Error {
    /// Every value [`Error::kind`] returns.
    pub const KINDS: [&'static str; 8] = [
        "conflict",
        "forbidden",
        "invalid",
        "api",
        "transport",
        "gang_scheduler_missing",
        "missing_metadata",
        "random",
    ];

    /// A short, bounded label for metrics (`rlplane_operator_reconcile_errors_total{error}`).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Kube { source, .. } => match source.as_ref() {
                kube::Error::Api(s) if s.code == 409 => "conflict",
                kube::Error::Api(s) if s.code == 403 => "forbidden",
                kube::Error::Api(s) if s.code == 422 || s.code == 400 => "invalid",
                kube::Error::Api(_) => "api",
                _ => "transport",
            },
            Error::GangSchedulerMissing { .. } => "gang_scheduler_missing",
            Error::MissingMetadata(_) => "missing_metadata",
            Error::Random(_) => "random",
        }
    }

    /// Wraps a client error with what was attempted.
    pub fn kube(action: &'static str, what: impl Into<String>, source: kube::Error) -> Error {
        Error::Kube { action, what: what.into(), source: Box::new(source) }
    }
}

/// Whether a client error is an API answer with this HTTP code.
pub fn is_code(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}
