//! Policy versions on samples: every sample carries, as its `policy_version` tag, the version of
//! the weights that generated it (the trainer's version `v` is the weights after step `v`; 0 is
//! the initial weights). A step `s` trained on a sample of version `v` trains `(s − 1) − v`
//! versions behind the synchronous schedule: the sample's *policy lag*. An asynchronous job
//! bounds it (`spec.schedule.maxPolicyLag`); the coordinator drops a sample beyond the bound at
//! its claim and every trainer rank refuses one in its batch.

use crate::column::{BatchMeta, SampleRef};

/// The tag naming the policy version that generated a sample (a decimal integer); with partial
/// rollouts, the first (oldest) version among its tokens, which the lag bound applies to.
pub const POLICY_VERSION_TAG: &str = "policy_version";

/// With partial rollouts (`spec.schedule.partialRollouts`): the last (newest) version among a
/// sample's tokens, when the engine took newer weights while generating it.
pub const POLICY_VERSION_LAST_TAG: &str = "policy_version_last";

/// The `(tag, value)` pair that marks a sample as generated with weights of `version`.
pub fn tag(version: u64) -> (String, String) {
    (POLICY_VERSION_TAG.to_string(), version.to_string())
}

/// Why a sample's policy version can't be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VersionError {
    /// The sample has no `policy_version` tag.
    #[error(
        "sample {key} carries no {POLICY_VERSION_TAG} tag: an asynchronous schedule needs every sample's generating version (the sidecar's put adds it; a producer that puts directly must tag each sample)"
    )]
    Untagged {
        /// The sample's key.
        key: String,
    },
    /// The tag is not a number.
    #[error("sample {key}: tag {POLICY_VERSION_TAG} = {value:?} is not a version number (a non-negative integer)")]
    Malformed {
        /// The sample's key.
        key: String,
        /// The tag's value.
        value: String,
    },
    /// The sample claims weights the trainer had not made when the step began.
    #[error(
        "sample {key} says it was generated with weights of version {version}, but step {step} trains on versions up to {}; a producer mislabels its samples",
        u64::from(*step).saturating_sub(1)
    )]
    FromTheFuture {
        /// The sample's key.
        key: String,
        /// Its version.
        version: u64,
        /// The step training it.
        step: u32,
    },
    /// The sample is older than the job's bound.
    #[error(
        "step {step}: sample {key} was generated with weights of version {version}, {lag} versions behind; spec.schedule.maxPolicyLag allows {max_lag}"
    )]
    TooOld {
        /// The sample's key.
        key: String,
        /// Its version.
        version: u64,
        /// The step training it.
        step: u32,
        /// Its lag.
        lag: u64,
        /// The bound.
        max_lag: u32,
    },
}

/// The sample's generating version: `None` when it has no tag.
pub fn of(sample: &SampleRef<'_>) -> Result<Option<u64>, VersionError> {
    let Some((_, value)) = sample.tags().iter().find(|(k, _)| k == POLICY_VERSION_TAG) else { return Ok(None) };
    value
        .parse::<u64>()
        .map(Some)
        .map_err(|_| VersionError::Malformed { key: sample.key().to_string(), value: value.clone() })
}

/// The policy lag of `sample` when step `step` trains it: `(step − 1) − version`. Refuses an
/// untagged sample only when `required`; an untagged sample otherwise has lag 0.
pub fn lag(sample: &SampleRef<'_>, step: u32, required: bool) -> Result<u64, VersionError> {
    let key = || sample.key().to_string();
    let Some(version) = of(sample)? else {
        return if required { Err(VersionError::Untagged { key: key() }) } else { Ok(0) };
    };
    let newest = u64::from(step).saturating_sub(1);
    if version > newest {
        return Err(VersionError::FromTheFuture { key: key(), version, step });
    }
    Ok(newest - version)
}

/// Checks that no sample of `batch` lags step `step` by more than `max_lag` versions; returns
/// the largest lag. With `max_lag` above 0 every sample must be tagged.
pub fn check_batch(batch: &BatchMeta, step: u32, max_lag: u32) -> Result<u64, VersionError> {
    let mut largest = 0;
    for i in 0..batch.len() {
        let s = batch.sample(i);
        let l = lag(&s, step, max_lag > 0)?;
        if l > u64::from(max_lag) {
            let version = of(&s)?.unwrap_or(0);
            return Err(VersionError::TooOld { key: s.key().to_string(), version, step, lag: l, max_lag });
        }
        largest = largest.max(l);
    }
    Ok(largest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::column::{BatchMeta, SampleTags};

    fn batch(tags: &[Option<&str>]) -> BatchMeta {
        let mut b = BatchMeta::builder("step-5", Vec::new());
        for (i, t) in tags.iter().enumerate() {
            let set: SampleTags = match t {
                Some(v) => vec![(POLICY_VERSION_TAG.to_string(), v.to_string())].into(),
                None => Vec::new().into(),
            };
            b.push(&format!("k{i}"), 0, 1, &[], &set).unwrap();
        }
        b.finish()
    }

    #[test]
    fn lag_counts_versions_behind_the_synchronous_one() {
        let b = batch(&[Some("4"), Some("3"), Some("2")]);
        let lags: Vec<u64> = (0..3).map(|i| lag(&b.sample(i), 5, true).unwrap()).collect();
        assert_eq!(lags, [0, 1, 2]);
        assert_eq!(check_batch(&b, 5, 2), Ok(2));
        let err = check_batch(&b, 5, 1).unwrap_err();
        assert!(matches!(err, VersionError::TooOld { lag: 2, max_lag: 1, .. }), "{err}");
        assert!(err.to_string().contains("spec.schedule.maxPolicyLag allows 1"), "{err}");
    }

    #[test]
    fn untagged_samples_pass_only_a_synchronous_check() {
        let b = batch(&[None]);
        assert_eq!(check_batch(&b, 5, 0), Ok(0));
        assert!(matches!(check_batch(&b, 5, 1), Err(VersionError::Untagged { .. })));
    }

    #[test]
    fn a_version_from_the_future_or_not_a_number_is_refused() {
        let b = batch(&[Some("5")]);
        assert!(matches!(check_batch(&b, 5, 3), Err(VersionError::FromTheFuture { version: 5, step: 5, .. })));
        let b = batch(&[Some("v4")]);
        let err = check_batch(&b, 5, 3).unwrap_err();
        assert!(err.to_string().contains("\"v4\" is not a version number"), "{err}");
    }
}
