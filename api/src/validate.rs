//! Static validation of an RLJob: every error at once, each with its field path and what to do.
//!
//! The operator and the local runner both call [`validate`]; the same rules (where CEL can express
//! them) are also in the CRD as `x-kubernetes-validations`, so the apiserver refuses a bad job
//! before the operator ever sees it.

use std::collections::HashSet;
use std::fmt;

use crate::model::{TpSplit, manifest_bytes};
use crate::spec::{
    Device, MAX_JOB_NAME_LEN, MAX_POLICY_LAG, Mode, RLJob, RLJobSpec, RefitTransport, SchedulePolicy, TqPlacement,
};

/// Ports the worker uses inside a pod (see [`crate::plan::ports`]); the metrics port must avoid them.
pub const RESERVED_PORTS: std::ops::RangeInclusive<u16> = 7000..=7999;

/// One problem with a spec: where it is and what to do about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Field path, e.g. `spec.trainer.parallelism`.
    pub path: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every problem found in a spec.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ValidationErrors(pub Vec<FieldError>);

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl ValidationErrors {
    /// The messages, one line each, for status conditions and Events.
    pub fn lines(&self) -> Vec<String> {
        self.0.iter().map(ToString::to_string).collect()
    }
}

#[derive(Default)]
struct Collector(Vec<FieldError>);

impl Collector {
    fn err(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(FieldError { path: path.into(), message: message.into() });
    }

    fn range<T: PartialOrd + fmt::Display + Copy>(&mut self, path: &str, v: T, min: T, max: T) {
        if v < min || v > max {
            self.err(path, format!("{v} is out of range; use a value from {min} to {max}"));
        }
    }

    fn finish(self) -> Result<(), ValidationErrors> {
        if self.0.is_empty() { Ok(()) } else { Err(ValidationErrors(self.0)) }
    }
}

/// Validates a whole RLJob: its metadata (name length) and its spec.
pub fn validate_job(job: &RLJob) -> Result<(), ValidationErrors> {
    let mut c = Collector::default();
    if let Some(name) = job.metadata.name.as_deref()
        && name.len() > MAX_JOB_NAME_LEN
    {
        c.err(
            "metadata.name",
            format!(
                "`{name}` has {} characters; at most {MAX_JOB_NAME_LEN}, so that pod and Service names stay valid DNS labels; choose a shorter name",
                name.len()
            ),
        );
    }
    if let Err(ValidationErrors(mut e)) = validate(&job.spec) {
        c.0.append(&mut e);
    }
    c.finish()
}

/// `spec.runPolicy.failurePolicy`: the limit's range, and each rule well formed.
fn failure_policy(p: &crate::FailurePolicy, c: &mut Collector) {
    c.range("spec.runPolicy.failurePolicy.disruptionLimit", p.disruption_limit, 0, 10000);
    if p.rules.len() > 20 {
        c.err("spec.runPolicy.failurePolicy.rules", format!("{} rules; at most 20", p.rules.len()));
    }
    for (i, r) in p.rules.iter().enumerate() {
        let path = format!("spec.runPolicy.failurePolicy.rules[{i}]");
        if r.on_exit_codes.is_some() == r.on_pod_conditions.is_some() {
            c.err(&path, "give exactly one of onExitCodes and onPodConditions");
        }
        if let Some(m) = &r.on_exit_codes {
            if m.values.is_empty() || m.values.len() > 255 {
                c.err(format!("{path}.onExitCodes.values"), "list 1 to 255 exit codes");
            }
            if m.operator == crate::ExitCodeOperator::In && m.values.contains(&0) {
                c.err(format!("{path}.onExitCodes.values"), "0 is no failure and cannot be matched with In; remove it");
            }
        }
        if let Some(conds) = &r.on_pod_conditions {
            if conds.is_empty() || conds.len() > 20 {
                c.err(format!("{path}.onPodConditions"), "list 1 to 20 condition types");
            }
            for (j, m) in conds.iter().enumerate() {
                if m.type_.is_empty() {
                    c.err(format!("{path}.onPodConditions[{j}].type"), "name a condition type, e.g. DisruptionTarget");
                }
            }
        }
    }
}

/// Validates a spec, returning every error found.
pub fn validate(spec: &RLJobSpec) -> Result<(), ValidationErrors> {
    let mut c = Collector::default();
    trainer_layout(spec, &mut c);
    generation_layout(spec, &mut c);
    images_and_templates(spec, &mut c);
    validate_model(spec, &mut c);
    refit_settings(spec, &mut c);
    transfer_queue(spec, &mut c);
    workload(spec, &mut c);
    run_policy(spec, &mut c);
    scheduling(spec, &mut c);
    observability(spec, &mut c);
    gpu_sharing(spec, &mut c);
    network_policy(spec, &mut c);
    schedule(spec, &mut c);
    c.finish()
}

/// `spec.trainer`: sizes, and a parallel layout that fills its GPUs.
fn trainer_layout(spec: &RLJobSpec, c: &mut Collector) {
    let t = &spec.trainer;
    let p = &t.parallelism;
    c.range("spec.trainer.nodes", t.nodes, 1, 1024);
    c.range("spec.trainer.gpusPerNode", t.gpus_per_node, 1, 16);
    c.range("spec.trainer.parallelism.tensor", p.tensor, 1, 64);
    c.range("spec.trainer.parallelism.pipeline", p.pipeline, 1, 64);
    c.range("spec.trainer.parallelism.context", p.context, 1, 64);
    c.range("spec.trainer.parallelism.data", p.data, 1, 4096);
    c.range("spec.trainer.parallelism.fsdp", p.fsdp, 1, 4096);
    if p.fsdp >= 1 && !p.data.is_multiple_of(p.fsdp) {
        c.err(
            "spec.trainer.parallelism.fsdp",
            format!(
                "{} does not divide data = {}; each shard group is fsdp consecutive data-parallel ranks, so use a divisor of data (data itself for FSDP)",
                p.fsdp, p.data
            ),
        );
    }
    let trainer_gpus = t.nodes as u64 * t.gpus_per_node as u64;
    if p.product() != trainer_gpus {
        c.err(
            "spec.trainer.parallelism",
            format!(
                "tensor×pipeline×context×data = {}×{}×{}×{} = {} but nodes×gpusPerNode = {}×{} = {}; make them equal",
                p.tensor,
                p.pipeline,
                p.context,
                p.data,
                p.product(),
                t.nodes,
                t.gpus_per_node,
                trainer_gpus
            ),
        );
    }
}

/// `spec.generation`: engines that fit the mode (the trainer's GPUs when colocated, whole pods when split).
fn generation_layout(spec: &RLJobSpec, c: &mut Collector) {
    let t = &spec.trainer;
    let g = &spec.generation;
    let trainer_gpus = t.nodes as u64 * t.gpus_per_node as u64;
    c.range("spec.generation.engines", g.engines, 1, 4096);
    c.range("spec.generation.tensorParallel", g.tensor_parallel, 1, 64);
    match spec.mode {
        Mode::Colocated => {
            if g.world() != trainer_gpus {
                c.err(
                    "spec.generation",
                    format!(
                        "in Colocated mode engines×tensorParallel = {}×{} = {} must equal the trainer's nodes×gpusPerNode = {}; generation shares the trainer's GPUs",
                        g.engines,
                        g.tensor_parallel,
                        g.world(),
                        trainer_gpus
                    ),
                );
            }
            if g.tensor_parallel > 0 && !t.gpus_per_node.is_multiple_of(g.tensor_parallel) {
                c.err(
                    "spec.generation.tensorParallel",
                    format!(
                        "{} does not divide trainer.gpusPerNode = {}; in Colocated mode an engine must fit in one pod",
                        g.tensor_parallel, t.gpus_per_node
                    ),
                );
            }
        }
        Mode::Split => {
            let pod_gpus = g.pod_gpus();
            c.range("spec.generation.gpusPerNode", pod_gpus, 1, 16);
            if g.tensor_parallel > 0 && !pod_gpus.is_multiple_of(g.tensor_parallel) {
                c.err(
                    "spec.generation.gpusPerNode",
                    format!(
                        "{pod_gpus} is not a multiple of tensorParallel = {}; an engine never spans pods",
                        g.tensor_parallel
                    ),
                );
            } else if let Some(per_pod) = pod_gpus.checked_div(g.tensor_parallel)
                && per_pod > 0
                && !g.engines.is_multiple_of(per_pod)
            {
                {
                    c.err(
                        "spec.generation.engines",
                        format!(
                            "{} engines do not fill pods of {per_pod} engines (gpusPerNode {pod_gpus} / tensorParallel {}); use a multiple of {per_pod}",
                            g.engines, g.tensor_parallel
                        ),
                    );
                }
            }
        }
    }
}

/// The roles' images and user pod templates.
fn images_and_templates(spec: &RLJobSpec, c: &mut Collector) {
    let t = &spec.trainer;
    let g = &spec.generation;
    for (role, image) in [("trainer", &t.image), ("generation", &g.image)] {
        if let Some(i) = image
            && i.trim().is_empty()
        {
            c.err(
                format!("spec.{role}.image"),
                "is empty; remove it to use the operator's worker image, or name an image",
            );
        }
    }
    for (role, tpl) in [("trainer", &t.template), ("generation", &g.template)] {
        if let Some(tpl) = tpl
            && let Err(e) = tpl.pod_template()
        {
            c.err(format!("spec.{role}.template"), format!("is not a valid pod template: {e}"));
        }
    }
}

/// `spec.refit`: buffers, alignment, timeout, and a transport the mode and device allow.
fn refit_settings(spec: &RLJobSpec, c: &mut Collector) {
    let r = &spec.refit;
    if r.buffer_bytes.is_some() && r.buffer_memory_fraction.is_some() {
        c.err("spec.refit", "set bufferBytes or bufferMemoryFraction, not both");
    }
    if let Some(b) = r.buffer_bytes {
        c.range("spec.refit.bufferBytes", b, 4096, u64::MAX);
        if r.align_bytes > b {
            c.err(
                "spec.refit.alignBytes",
                format!("{} exceeds bufferBytes = {b}; use a smaller alignment", r.align_bytes),
            );
        }
    }
    if let Some(f) = r.buffer_memory_fraction
        && !(f > 0.0 && f <= 0.5)
    {
        c.err("spec.refit.bufferMemoryFraction", format!("{f} is out of range; use a fraction in (0, 0.5]"));
    }
    c.range("spec.refit.numBuffers", r.num_buffers, 1, 8);
    if !r.align_bytes.is_power_of_two() || r.align_bytes > 1 << 20 {
        c.err("spec.refit.alignBytes", format!("{} must be a power of two up to 1048576 (e.g. 256)", r.align_bytes));
    }
    c.range("spec.refit.timeoutSeconds", r.timeout_seconds, 1, 86400);
    if spec.mode == Mode::Colocated && r.transport == RefitTransport::Nccl {
        c.err(
            "spec.refit.transport",
            "Nccl cannot serve Colocated mode: a trainer rank and a generation rank share each GPU and NCCL puts one rank on a GPU; use CudaIpc or Auto",
        );
    }
    if spec.device == Device::Cpu && matches!(r.transport, RefitTransport::Nccl | RefitTransport::CudaIpc) {
        c.err("spec.refit.transport", format!("{:?} needs GPUs but spec.device is Cpu; use Tcp or Auto", r.transport));
    }
}

/// `spec.transferQueue`.
fn transfer_queue(spec: &RLJobSpec, c: &mut Collector) {
    let q = &spec.transfer_queue;
    if q.placement == TqPlacement::Dedicated {
        c.range("spec.transferQueue.storageUnits", q.storage_units, 1, 256);
    }
    c.range("spec.transferQueue.capacityBytes", q.capacity_bytes, 1 << 20, u64::MAX);
    c.range("spec.transferQueue.leaseSeconds", q.lease_seconds, 1, 86400);
    c.range("spec.transferQueue.putTimeoutSeconds", q.put_timeout_seconds, 1, 86400);
}

/// `spec.workload`: sizes, and samples enough for every data-parallel shard.
fn workload(spec: &RLJobSpec, c: &mut Collector) {
    let p = &spec.trainer.parallelism;
    let w = &spec.workload;
    c.range("spec.workload.steps", w.steps, 1, 1_000_000);
    c.range("spec.workload.promptsPerStep", w.prompts_per_step, 1, 1_000_000);
    c.range("spec.workload.samplesPerPrompt", w.samples_per_prompt, 1, 1024);
    c.range("spec.workload.promptTokens", w.prompt_tokens, 1, 1 << 20);
    c.range("spec.workload.responseTokens.min", w.response_tokens.min, 1, 1 << 20);
    c.range("spec.workload.responseTokens.max", w.response_tokens.max, 1, 1 << 20);
    if w.response_tokens.min > w.response_tokens.max {
        c.err(
            "spec.workload.responseTokens",
            format!("min = {} exceeds max = {}; swap them", w.response_tokens.min, w.response_tokens.max),
        );
    }
    for (field, r) in [("generateMillis", &w.generate_millis), ("trainMillis", &w.train_millis)] {
        c.range(&format!("spec.workload.{field}.max"), r.max, 0, 3_600_000);
        if r.min > r.max {
            c.err(format!("spec.workload.{field}"), format!("min = {} exceeds max = {}; swap them", r.min, r.max));
        }
    }
    if w.samples_per_step() < p.data as u64 {
        c.err(
            "spec.workload",
            format!(
                "promptsPerStep×samplesPerPrompt = {} is less than trainer.parallelism.data = {}; every data-parallel shard needs samples",
                w.samples_per_step(),
                p.data
            ),
        );
    }
}

/// `spec.schedule`: a lag only where generation may run ahead, and no more than the transfer
/// queue is sized to hold.
fn schedule(spec: &RLJobSpec, c: &mut Collector) {
    let s = &spec.schedule;
    match (s.policy, s.max_policy_lag) {
        (SchedulePolicy::Synchronous, Some(k)) if k > 0 => c.err(
            "spec.schedule.maxPolicyLag",
            format!("{k} needs policy: Asynchronous (a synchronous schedule never lets generation run ahead); set it, or leave maxPolicyLag out"),
        ),
        (_, Some(k)) => c.range("spec.schedule.maxPolicyLag", k, 0, MAX_POLICY_LAG),
        _ => {}
    }
    if s.partial_rollouts && s.policy == SchedulePolicy::Synchronous {
        c.err(
            "spec.schedule.partialRollouts",
            "needs policy: Asynchronous (a synchronous engine never has newer weights to take inside a step); set it, or leave partialRollouts out",
        );
    }
}

/// `spec.runPolicy`.
fn run_policy(spec: &RLJobSpec, c: &mut Collector) {
    c.range("spec.runPolicy.backoffLimit", spec.run_policy.backoff_limit, 0, 1000);
    if spec.run_policy.active_deadline_seconds == Some(0) {
        c.err("spec.runPolicy.activeDeadlineSeconds", "0 would fail the job at once; use at least 1 or remove it");
    }
    c.range("spec.runPolicy.terminationGracePeriodSeconds", spec.run_policy.termination_grace_period_seconds, 0, 3600);
    failure_policy(&spec.run_policy.failure_policy, c);
}

/// `spec.scheduling`: names the API server would refuse.
fn scheduling(spec: &RLJobSpec, c: &mut Collector) {
    let s = &spec.scheduling;
    for (path, v) in [
        ("spec.scheduling.schedulerName", &s.scheduler_name),
        ("spec.scheduling.priorityClassName", &s.priority_class_name),
        ("spec.scheduling.queueName", &s.queue_name),
    ] {
        if let Some(v) = v
            && (v.is_empty() || v.len() > 253)
        {
            c.err(path, "must be 1 to 253 characters; remove it to use the default");
        }
    }
}

/// `spec.observability`: a metrics port clear of the worker's, an OTLP URL.
fn observability(spec: &RLJobSpec, c: &mut Collector) {
    let port = spec.observability.metrics_port;
    c.range("spec.observability.metricsPort", port, 1024, 65535);
    if RESERVED_PORTS.contains(&port) {
        c.err(
            "spec.observability.metricsPort",
            format!("{port} falls in 7000-7999, which the worker uses for refit and the transfer queue; pick another port (default 9400)"),
        );
    }
    if let Some(e) = &spec.observability.otlp_endpoint
        && !(e.starts_with("http://") || e.starts_with("https://"))
    {
        c.err(
            "spec.observability.otlpEndpoint",
            format!("`{e}` must be an http:// or https:// URL (e.g. http://otel-collector:4317)"),
        );
    }
}

/// `spec.networkPolicy`: its label selectors must be valid Kubernetes labels, or the policy's
/// apply fails later, with a message about the NetworkPolicy instead of this field.
fn network_policy(spec: &RLJobSpec, c: &mut Collector) {
    let np = &spec.network_policy;
    for (path, labels) in [
        ("spec.networkPolicy.metricsScraperLabels", &np.metrics_scraper_labels),
        ("spec.networkPolicy.metricsScraperNamespaceLabels", &np.metrics_scraper_namespace_labels),
    ] {
        for (k, v) in labels {
            if !is_label_key(k) {
                c.err(
                    path,
                    format!(
                        "`{k}` is not a label key: use [prefix/]name, name at most 63 letters, digits, '-', '_' or '.' starting and ending with a letter or digit (e.g. app.kubernetes.io/name)"
                    ),
                );
            } else if !is_label_value(v) {
                c.err(
                    path,
                    format!(
                        "the value `{v}` of `{k}` is not a label value: at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit (e.g. prometheus)"
                    ),
                );
            }
        }
    }
}

/// `spec.gpus`: a ResourceClaim needs GPUs, a DeviceClass, and no device-plugin requests beside it.
fn gpu_sharing(spec: &RLJobSpec, c: &mut Collector) {
    if spec.gpus.sharing != crate::GpuSharing::ResourceClaim {
        return;
    }
    if spec.device != crate::Device::Gpu {
        c.err(
            "spec.gpus.sharing",
            "ResourceClaim shares the pods' GPUs, and device Cpu has none: set device Gpu, or leave spec.gpus out",
        );
    }
    match spec.gpus.device_class_name.as_deref() {
        None | Some("") => c.err(
            "spec.gpus.deviceClassName",
            "sharing ResourceClaim allocates the pod's GPUs from a DeviceClass; name it (e.g. gpu.nvidia.com)",
        ),
        Some(n) if !is_dns_subdomain(n) => c.err(
            "spec.gpus.deviceClassName",
            format!("`{n}` is not a DeviceClass name: lowercase letters, digits, '-' and '.', at most 253 (e.g. gpu.nvidia.com)"),
        ),
        Some(_) => {}
    }
    for (path, template) in
        [("spec.trainer.template", &spec.trainer.template), ("spec.generation.template", &spec.generation.template)]
    {
        let Some(spec) = template.as_ref().and_then(|t| t.pod_template().ok()).and_then(|t| t.spec) else { continue };
        for (i, ctr) in spec.containers.iter().enumerate() {
            let r = ctr.resources.as_ref();
            for (field, list) in
                [("limits", r.and_then(|r| r.limits.as_ref())), ("requests", r.and_then(|r| r.requests.as_ref()))]
            {
                if list.is_some_and(|l| l.contains_key("nvidia.com/gpu")) {
                    c.err(
                        format!("{path}.spec.containers[{i}].resources.{field}"),
                        "nvidia.com/gpu with spec.gpus.sharing ResourceClaim: the pod's GPUs come from its ResourceClaim, which every container uses; remove the request",
                    );
                }
            }
        }
    }
}

/// A DNS subdomain (RFC 1123): at most 253 characters of lowercase letters, digits, '-' and '.',
/// alphanumeric at both ends.
fn is_dns_subdomain(n: &str) -> bool {
    n.len() <= 253
        && n.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && n.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && n.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
}

/// A label value: empty, or at most 63 of `[A-Za-z0-9._-]`, alphanumeric at both ends.
fn is_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    v.is_empty()
        || (b.len() <= 63
            && b.iter().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric())
}

/// A label key: `[prefix/]name`, the prefix a DNS subdomain (at most 253), the name a non-empty
/// label value.
fn is_label_key(k: &str) -> bool {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                let b = part.as_bytes();
                !b.is_empty()
                    && b.len() <= 63
                    && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                    && b[0] != b'-'
                    && b[b.len() - 1] != b'-'
            })
    });
    prefix_ok && !name.is_empty() && is_label_value(name)
}

fn validate_model(spec: &RLJobSpec, c: &mut Collector) {
    let m = &spec.model;
    match (&m.preset, &m.tensors) {
        (Some(_), Some(_)) => c.err("spec.model", "give exactly one of preset and tensors, not both"),
        (None, None) => c.err("spec.model", "give one of preset (llama3-8b, qwen3-0.6b, tiny) or tensors"),
        (None, Some(t)) if t.is_empty() => c.err("spec.model.tensors", "is empty; list at least one tensor"),
        _ => {}
    }
    let tensors = m.manifest();
    let mut names = HashSet::new();
    for (i, t) in tensors.iter().enumerate() {
        let path = format!("spec.model.tensors[{i}]");
        if t.name.is_empty() || t.name.len() > 256 {
            c.err(format!("{path}.name"), "must be 1 to 256 characters");
        }
        if !names.insert(t.name.as_str()) {
            c.err(format!("{path}.name"), format!("`{}` appears twice; tensor names must be unique", t.name));
        }
        if t.shape.is_empty() || t.shape.len() > 8 {
            c.err(format!("{path}.shape"), format!("has {} dimensions; use 1 to 8", t.shape.len()));
        }
        if t.shape.contains(&0) {
            c.err(
                format!("{path}.shape"),
                format!("{:?} has a zero dimension; every dimension must be at least 1", t.shape),
            );
        }
    }
    if manifest_bytes(&tensors) == u64::MAX {
        c.err("spec.model.tensors", "total size overflows 64 bits; check the shapes");
    }
    let p = &spec.trainer.parallelism;
    if p.tensor > 1 {
        let mut bad = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            let ok = match t.effective_split() {
                TpSplit::Replicated => true,
                TpSplit::Rows => t.shape.first().is_some_and(|&d| d % p.tensor as u64 == 0),
                TpSplit::Columns => t.shape.len() >= 2 && t.shape[1] % p.tensor as u64 == 0,
            };
            if !ok {
                bad.push((i, t));
            }
        }
        if !bad.is_empty() {
            let list: Vec<String> = bad
                .iter()
                .take(3)
                .map(|(i, t)| format!("[{i}] {} {:?} split {:?}", t.name, t.shape, t.effective_split()))
                .collect();
            c.err(
                "spec.model.tensors",
                format!(
                    "{} tensor(s) cannot be split across trainer.parallelism.tensor = {}: {}{}; make the split dimension divisible or set tpSplit: Replicated",
                    bad.len(),
                    p.tensor,
                    list.join(", "),
                    if bad.len() > 3 { ", ..." } else { "" }
                ),
            );
        }
    }
    if !tensors.is_empty() && (p.pipeline as usize) > tensors.len() {
        c.err(
            "spec.trainer.parallelism.pipeline",
            format!(
                "{} stages but the model has only {} tensors; use at most {}",
                p.pipeline,
                tensors.len(),
                tensors.len()
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{is_label_key, is_label_value};

    #[test]
    fn label_keys_and_values_follow_kubernetes() {
        for ok in ["app", "app.kubernetes.io/name", "kubernetes.io/metadata.name", "a_b-c.d", "A9"] {
            assert!(is_label_key(ok), "{ok}");
        }
        for bad in ["", "/name", "-app", "app-", "Example.com/x", "a/b/c", "x/", &"n".repeat(64)] {
            assert!(!is_label_key(bad), "{bad}");
        }
        for ok in ["", "prometheus", "kube-prometheus-stack", "v1.2_3"] {
            assert!(is_label_value(ok), "{ok}");
        }
        for bad in ["prometheus server", "-x", "x.", &"v".repeat(64)] {
            assert!(!is_label_value(bad), "{bad}");
        }
    }
}
