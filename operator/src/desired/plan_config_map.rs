//! The ConfigMap that carries the epoch's worker plan to every pod.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use rlplane_api::topology::plan_config_map_name;

use super::{JobMeta, PLAN_KEY, labels};

/// The plan ConfigMap: `plan_json` under [`PLAN_KEY`], labelled with the epoch. It holds no
/// secret: the plan names where the key is mounted.
pub(super) fn plan_config_map(meta: &JobMeta, epoch: u32, plan_json: String) -> ConfigMap {
    ConfigMap {
        metadata: meta
            .object(plan_config_map_name(&meta.job), BTreeMap::from([(labels::EPOCH.into(), epoch.to_string())])),
        data: Some(BTreeMap::from([(PLAN_KEY.into(), plan_json)])),
        ..Default::default()
    }
}
