//! The epoch's key Secret: its metadata here, its random key from the caller.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use rlplane_api::plan::{JOB_KEY_LEN, JOB_KEY_SECRET_KEY, encode_job_key, job_key_secret_name};

use super::{Desired, JobMeta, labels};

/// `<job>-key-<uid>-e<epoch>`, without its data: an immutable Opaque Secret labelled with the
/// epoch.
pub(super) fn key_secret(meta: &JobMeta, uid: &str, epoch: u32) -> Secret {
    Secret {
        metadata: meta.object(
            job_key_secret_name(&meta.job, uid, epoch),
            BTreeMap::from([(labels::EPOCH.into(), epoch.to_string())]),
        ),
        type_: Some("Opaque".into()),
        // Never rewritten in place: a new epoch gets a new Secret, so running pods never see
        // their key change.
        immutable: Some(true),
        ..Default::default()
    }
}

impl Desired {
    /// The epoch's key Secret holding `key` (64 hex characters under `key`), to create once per
    /// epoch. The key is an argument so that this stays pure: the controller draws it from the
    /// operating system's random source.
    pub fn key_secret_with(&self, key: &[u8; JOB_KEY_LEN]) -> Secret {
        let mut s = self.key_secret.clone();
        s.data = Some(BTreeMap::from([(JOB_KEY_SECRET_KEY.into(), ByteString(encode_job_key(key).into_bytes()))]));
        s
    }
}
