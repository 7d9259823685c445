//! The built-in synthetic GRPO workload: which samples a step has, their lengths, their bytes.
//!
//! Everything is a pure function of the [`WorkloadSpec`] and the step, so any process (a
//! generation rank producing rollouts, the coordinator checking totals, a test) derives the same
//! samples without talking to anyone. Prompt `p` of a step goes to engine `p % engines`; each
//! prompt has `samplesPerPrompt` responses (the GRPO group) with lengths drawn uniformly from
//! `responseTokens`.

use rlplane_api::WorkloadSpec;

use crate::digest::mix64;

/// Vocabulary size of the synthetic token ids.
pub const VOCAB: u64 = 32_000;

/// Field names of a rollout in the transfer queue.
pub mod fields {
    /// Prompt and response token ids, i64 per token (ragged).
    pub const INPUT_IDS: &str = "input_ids";
    /// 0 for prompt tokens, 1 for response tokens, u8 per token (ragged).
    pub const RESPONSE_MASK: &str = "response_mask";
    /// The generating policy's log-probabilities, f32 per response token (ragged).
    pub const OLD_LOGPROBS: &str = "old_logprobs";
    /// The sample's reward, f32 scalar.
    pub const REWARD: &str = "reward";
    /// Written back by the trainer: its own log-probabilities, f32 per response token (ragged).
    pub const LOGPROBS: &str = "logprobs";
}

/// One sample of a step, before it is generated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SampleSpec {
    /// Prompt index within the step.
    pub prompt: u32,
    /// Response index within the prompt's group.
    pub sample: u32,
    /// Key in the transfer queue: `"{uid}_g{i}"` with uid = `s{step}p{prompt}`.
    pub key: String,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Response length in tokens.
    pub response_tokens: u32,
}

impl SampleSpec {
    /// Tokens in the sample (prompt + response).
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens as u64 + self.response_tokens as u64
    }

    /// Bytes the sample puts into the transfer queue (values only; offsets are framing).
    pub fn bytes(&self) -> u64 {
        let t = self.tokens();
        let r = self.response_tokens as u64;
        t * 8 + t + r * 4 + 4
    }
}

fn seed_of(w: &WorkloadSpec, step: u32, prompt: u32, sample: u32, salt: u64) -> u64 {
    mix64(w.seed ^ mix64(((step as u64) << 40) ^ ((prompt as u64) << 16) ^ sample as u64 ^ salt))
}

/// Every sample of a step, in prompt-major order.
pub fn step_samples(w: &WorkloadSpec, step: u32) -> Vec<SampleSpec> {
    let (min, max) = (w.response_tokens.min, w.response_tokens.max.max(w.response_tokens.min));
    let span = (max - min) as u64 + 1;
    let mut v = Vec::with_capacity(w.samples_per_step() as usize);
    for prompt in 0..w.prompts_per_step {
        for sample in 0..w.samples_per_prompt {
            let r = min + (seed_of(w, step, prompt, sample, 0x006c_656e) % span) as u32;
            v.push(SampleSpec {
                prompt,
                sample,
                key: format!("s{step}p{prompt}_g{sample}"),
                prompt_tokens: w.prompt_tokens,
                response_tokens: r,
            });
        }
    }
    v
}

/// The simulated decoding time of `engine`'s rollouts of `step` (`workload.generateMillis`).
pub fn generate_delay(w: &WorkloadSpec, step: u32, engine: u32) -> std::time::Duration {
    w.generate_millis.pick(seed_of(w, step, engine, u32::MAX, 0x0067_656e))
}

/// The simulated forward and backward time of trainer rank `rank` in `step` (`workload.trainMillis`).
pub fn train_delay(w: &WorkloadSpec, step: u32, rank: u32) -> std::time::Duration {
    w.train_millis.pick(seed_of(w, step, rank, u32::MAX, 0x0074_726e))
}

/// The samples an engine produces in a step.
pub fn engine_samples(w: &WorkloadSpec, step: u32, engine: u32, engines: u32) -> Vec<SampleSpec> {
    step_samples(w, step).into_iter().filter(|s| s.prompt % engines.max(1) == engine).collect()
}

/// A generated rollout.
#[derive(Clone, Debug, PartialEq)]
pub struct Rollout {
    /// Prompt then response token ids.
    pub input_ids: Vec<i64>,
    /// 0 for prompt tokens, 1 for response tokens.
    pub response_mask: Vec<u8>,
    /// Log-probabilities of the response tokens.
    pub old_logprobs: Vec<f32>,
    /// Reward.
    pub reward: f32,
}

/// The scalars a synthetic engine reports for its rollouts of a step, as a user's engine would:
/// their mean reward and mean response length.
pub fn rollout_scalars(rollouts: &[Rollout]) -> std::collections::BTreeMap<String, f64> {
    if rollouts.is_empty() {
        return Default::default();
    }
    let n = rollouts.len() as f64;
    let reward = rollouts.iter().map(|r| r.reward as f64).sum::<f64>() / n;
    let length = rollouts.iter().map(|r| r.old_logprobs.len() as f64).sum::<f64>() / n;
    [("reward_mean".to_string(), reward), ("response_tokens_mean".to_string(), length)].into()
}

/// Generates a sample's rollout. The prompt's tokens are shared by its whole group, as in GRPO.
pub fn rollout(w: &WorkloadSpec, step: u32, s: &SampleSpec) -> Rollout {
    let p = s.prompt_tokens as usize;
    let r = s.response_tokens as usize;
    let prompt_seed = seed_of(w, step, s.prompt, u32::MAX, 0x7072);
    let resp_seed = seed_of(w, step, s.prompt, s.sample, 0x7265);
    let mut input_ids = Vec::with_capacity(p + r);
    input_ids.extend((0..p as u64).map(|i| (mix64(prompt_seed ^ i) % VOCAB) as i64));
    input_ids.extend((0..r as u64).map(|i| (mix64(resp_seed ^ i) % VOCAB) as i64));
    let mut response_mask = vec![0u8; p + r];
    response_mask[p..].fill(1);
    let old_logprobs = (0..r as u64).map(|i| -((mix64(resp_seed ^ !i) % 1000) as f32) / 100.0).collect();
    let reward = (seed_of(w, step, s.prompt, s.sample, 0x7277) % 2) as f32;
    Rollout { input_ids, response_mask, old_logprobs, reward }
}

/// The trainer's per-token field written back for a sample: a deterministic function of the
/// response tokens, so it can be checked.
pub fn trainer_logprobs(input_ids: &[i64], response_mask: &[u8]) -> Vec<f32> {
    input_ids
        .iter()
        .zip(response_mask)
        .filter(|(_, m)| **m == 1)
        .map(|(id, _)| -((*id as u64 % 977) as f32) / 97.7)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> WorkloadSpec {
        serde_json::from_value(serde_json::json!({
            "steps": 2, "promptsPerStep": 5, "samplesPerPrompt": 3, "promptTokens": 7,
            "responseTokens": {"min": 4, "max": 9}, "seed": 1
        }))
        .unwrap()
    }

    #[test]
    fn samples_are_deterministic_in_range_and_split_across_engines() {
        let w = spec();
        let a = step_samples(&w, 1);
        assert_eq!(a, step_samples(&w, 1));
        assert_ne!(a, step_samples(&w, 2));
        assert_eq!(a.len(), 15);
        assert!(a.iter().all(|s| (4..=9).contains(&s.response_tokens)));
        let keys: std::collections::HashSet<_> = a.iter().map(|s| s.key.clone()).collect();
        assert_eq!(keys.len(), 15);
        let mut per_engine: Vec<SampleSpec> = (0..2).flat_map(|e| engine_samples(&w, 1, e, 2)).collect();
        per_engine.sort_by_key(|s| (s.prompt, s.sample));
        assert_eq!(per_engine, a);
    }

    #[test]
    fn a_rollout_has_the_lengths_and_bytes_of_its_spec() {
        let w = spec();
        for s in step_samples(&w, 0) {
            let r = rollout(&w, 0, &s);
            assert_eq!(r.input_ids.len() as u64, s.tokens());
            assert_eq!(r.response_mask.iter().filter(|m| **m == 1).count(), s.response_tokens as usize);
            assert_eq!(r.old_logprobs.len(), s.response_tokens as usize);
            let bytes = r.input_ids.len() * 8 + r.response_mask.len() + r.old_logprobs.len() * 4 + 4;
            assert_eq!(bytes as u64, s.bytes());
            assert_eq!(trainer_logprobs(&r.input_ids, &r.response_mask).len(), s.response_tokens as usize);
        }
        // The group shares its prompt.
        let s = step_samples(&w, 0);
        let a = rollout(&w, 0, &s[0]);
        let b = rollout(&w, 0, &s[1]);
        assert_eq!(a.input_ids[..7], b.input_ids[..7]);
    }
}
