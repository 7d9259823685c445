//! The parameter manifest that refit moves: element types, tensors, presets and how a trainer
//! shards them (tensor-parallel splits, pipeline stages).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum DType {
    /// bfloat16, 2 bytes.
    #[serde(rename = "bf16")]
    Bf16,
    /// IEEE half, 2 bytes.
    #[serde(rename = "f16")]
    F16,
    /// IEEE single, 4 bytes.
    #[serde(rename = "f32")]
    F32,
    /// 8-bit float (e4m3), 1 byte.
    #[serde(rename = "fp8e4m3")]
    Fp8E4m3,
    /// Signed 8-bit integer.
    #[serde(rename = "i8")]
    I8,
    /// Unsigned 8-bit integer.
    #[serde(rename = "u8")]
    U8,
    /// Signed 32-bit integer.
    #[serde(rename = "i32")]
    I32,
    /// Signed 64-bit integer.
    #[serde(rename = "i64")]
    I64,
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::Fp8E4m3 | DType::I8 | DType::U8 => 1,
            DType::Bf16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    /// The name used in manifests (`bf16`, `f32`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::Fp8E4m3 => "fp8e4m3",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }
}

/// How a tensor is split across the trainer's tensor-parallel ranks (Megatron convention).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum TpSplit {
    /// Every tensor-parallel rank holds the whole tensor (norms, biases of row-parallel layers).
    Replicated,
    /// Split along dimension 0 (column-parallel linear layers, vocab-parallel embeddings).
    /// Each rank's slice is one contiguous byte range of the full tensor.
    Rows,
    /// Split along dimension 1 (row-parallel linear layers such as `o_proj`, `down_proj`).
    /// Each rank's slice is strided in the full tensor.
    Columns,
}

/// One parameter tensor of the model, in the layout the generation engine holds it (full, unsharded).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TensorSpec {
    /// Parameter name, unique within the manifest (e.g. `model.layers.0.self_attn.q_proj.weight`).
    #[schemars(length(min = 1, max = 256))]
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape, outermost dimension first; every dimension at least 1.
    #[schemars(length(min = 1, max = 8))]
    pub shape: Vec<u64>,
    /// How the trainer's tensor-parallel ranks split this tensor. Defaults to `Rows` for tensors of
    /// two or more dimensions and `Replicated` for vectors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_split: Option<TpSplit>,
}

impl TensorSpec {
    /// Builds a tensor spec with the default tensor-parallel split.
    pub fn new(name: impl Into<String>, dtype: DType, shape: Vec<u64>) -> Self {
        TensorSpec { name: name.into(), dtype, shape, tp_split: None }
    }

    /// Builds a tensor spec with an explicit tensor-parallel split.
    pub fn with_split(name: impl Into<String>, dtype: DType, shape: Vec<u64>, split: TpSplit) -> Self {
        TensorSpec { name: name.into(), dtype, shape, tp_split: Some(split) }
    }

    /// Number of elements (saturating, so absurd shapes cannot overflow).
    pub fn numel(&self) -> u64 {
        self.shape.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Size in bytes (saturating).
    pub fn size_bytes(&self) -> u64 {
        self.numel().saturating_mul(self.dtype.size_bytes())
    }

    /// The split actually used: the explicit one, or the default for the tensor's rank.
    pub fn effective_split(&self) -> TpSplit {
        match self.tp_split {
            Some(s) => s,
            None if self.shape.len() >= 2 => TpSplit::Rows,
            None => TpSplit::Replicated,
        }
    }

    /// The tensor viewed as a 2-D byte matrix `[rows, row_bytes]`: dimension 0 is the rows, all
    /// other dimensions are folded into a row. A vector is one row.
    pub fn as_byte_matrix(&self) -> (u64, u64) {
        if self.shape.len() <= 1 {
            return (1, self.size_bytes());
        }
        let rows = self.shape[0];
        let row_elems = self.shape[1..].iter().fold(1u64, |acc, &d| acc.saturating_mul(d));
        (rows, row_elems.saturating_mul(self.dtype.size_bytes()))
    }
}

/// Built-in model manifests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum ModelPreset {
    /// Llama-3-8B in bf16: 291 tensors, 16.06 GB.
    #[serde(rename = "llama3-8b")]
    Llama3_8b,
    /// Qwen3-0.6B in bf16 (tied embeddings): 310 tensors, 1.19 GB.
    #[serde(rename = "qwen3-0.6b")]
    Qwen3_0_6b,
    /// A Llama-shaped model of 1.3 MB (17 tensors) for tests and laptops.
    #[serde(rename = "tiny")]
    Tiny,
}

impl ModelPreset {
    /// The preset's name as written in manifests.
    pub const fn as_str(self) -> &'static str {
        match self {
            ModelPreset::Llama3_8b => "llama3-8b",
            ModelPreset::Qwen3_0_6b => "qwen3-0.6b",
            ModelPreset::Tiny => "tiny",
        }
    }

    /// Every preset, for help texts and tests.
    pub const ALL: [ModelPreset; 3] = [ModelPreset::Llama3_8b, ModelPreset::Qwen3_0_6b, ModelPreset::Tiny];

    /// The preset's tensors, in the order a Hugging Face checkpoint lists them.
    pub fn tensors(self) -> Vec<TensorSpec> {
        match self {
            ModelPreset::Llama3_8b => decoder_manifest(&DecoderShape {
                vocab: 128_256,
                hidden: 4096,
                intermediate: 14_336,
                layers: 32,
                q_heads: 32,
                kv_heads: 8,
                head_dim: 128,
                qk_norm: false,
                tied_embeddings: false,
            }),
            ModelPreset::Qwen3_0_6b => decoder_manifest(&DecoderShape {
                vocab: 151_936,
                hidden: 1024,
                intermediate: 3072,
                layers: 28,
                q_heads: 16,
                kv_heads: 8,
                head_dim: 128,
                qk_norm: true,
                tied_embeddings: true,
            }),
            ModelPreset::Tiny => decoder_manifest(&DecoderShape {
                vocab: 1024,
                hidden: 128,
                intermediate: 384,
                layers: 2,
                q_heads: 4,
                kv_heads: 2,
                head_dim: 32,
                qk_norm: false,
                tied_embeddings: false,
            }),
        }
    }
}

impl std::fmt::Display for ModelPreset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ModelPreset {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ModelPreset::ALL.into_iter().find(|p| p.as_str() == s).ok_or_else(|| {
            let names: Vec<_> = ModelPreset::ALL.iter().map(|p| p.as_str()).collect();
            format!("unknown model preset `{s}`; expected one of {}", names.join(", "))
        })
    }
}

/// Dimensions of a Llama/Qwen-style decoder, enough to list its parameters.
struct DecoderShape {
    vocab: u64,
    hidden: u64,
    intermediate: u64,
    layers: u64,
    q_heads: u64,
    kv_heads: u64,
    head_dim: u64,
    qk_norm: bool,
    tied_embeddings: bool,
}

fn decoder_manifest(s: &DecoderShape) -> Vec<TensorSpec> {
    use TpSplit::{Columns, Replicated, Rows};
    let bf16 = DType::Bf16;
    let q_dim = s.q_heads * s.head_dim;
    let kv_dim = s.kv_heads * s.head_dim;
    let mut t = vec![TensorSpec::with_split("model.embed_tokens.weight", bf16, vec![s.vocab, s.hidden], Rows)];
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        t.push(TensorSpec::with_split(format!("{p}.self_attn.q_proj.weight"), bf16, vec![q_dim, s.hidden], Rows));
        t.push(TensorSpec::with_split(format!("{p}.self_attn.k_proj.weight"), bf16, vec![kv_dim, s.hidden], Rows));
        t.push(TensorSpec::with_split(format!("{p}.self_attn.v_proj.weight"), bf16, vec![kv_dim, s.hidden], Rows));
        t.push(TensorSpec::with_split(format!("{p}.self_attn.o_proj.weight"), bf16, vec![s.hidden, q_dim], Columns));
        if s.qk_norm {
            t.push(TensorSpec::with_split(format!("{p}.self_attn.q_norm.weight"), bf16, vec![s.head_dim], Replicated));
            t.push(TensorSpec::with_split(format!("{p}.self_attn.k_norm.weight"), bf16, vec![s.head_dim], Replicated));
        }
        t.push(TensorSpec::with_split(format!("{p}.mlp.gate_proj.weight"), bf16, vec![s.intermediate, s.hidden], Rows));
        t.push(TensorSpec::with_split(format!("{p}.mlp.up_proj.weight"), bf16, vec![s.intermediate, s.hidden], Rows));
        t.push(TensorSpec::with_split(
            format!("{p}.mlp.down_proj.weight"),
            bf16,
            vec![s.hidden, s.intermediate],
            Columns,
        ));
        t.push(TensorSpec::with_split(format!("{p}.input_layernorm.weight"), bf16, vec![s.hidden], Replicated));
        t.push(TensorSpec::with_split(
            format!("{p}.post_attention_layernorm.weight"),
            bf16,
            vec![s.hidden],
            Replicated,
        ));
    }
    t.push(TensorSpec::with_split("model.norm.weight", bf16, vec![s.hidden], Replicated));
    if !s.tied_embeddings {
        t.push(TensorSpec::with_split("lm_head.weight", bf16, vec![s.vocab, s.hidden], Rows));
    }
    t
}

/// Total bytes of a manifest (saturating).
pub fn manifest_bytes(tensors: &[TensorSpec]) -> u64 {
    tensors.iter().fold(0u64, |acc, t| acc.saturating_add(t.size_bytes()))
}

/// Assigns each tensor of a manifest to a pipeline stage: contiguous runs in manifest order,
/// balanced by bytes (greedy: a stage closes once it holds its share of what is left). Every stage
/// gets at least one tensor when `stages <= tensors.len()`.
pub fn pipeline_stages(tensors: &[TensorSpec], stages: u32) -> Vec<u32> {
    let stages = stages.max(1) as usize;
    let n = tensors.len();
    let mut out = Vec::with_capacity(n);
    let mut remaining: u64 = manifest_bytes(tensors);
    let mut stage = 0usize;
    let mut in_stage: u64 = 0;
    let mut count_in_stage = 0usize;
    for (i, t) in tensors.iter().enumerate() {
        let stages_left = stages - stage;
        let tensors_left = n - i;
        // Close the current stage when it has its share, or when the remaining tensors are only
        // just enough to give each later stage one.
        let share = remaining.div_ceil(stages_left as u64);
        if stage + 1 < stages
            && count_in_stage > 0
            && (in_stage + t.size_bytes() / 2 > share || tensors_left < stages_left)
        {
            remaining -= in_stage;
            stage += 1;
            in_stage = 0;
            count_in_stage = 0;
        }
        out.push(stage as u32);
        in_stage += t.size_bytes();
        count_in_stage += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_8b_matches_the_published_checkpoint() {
        let t = ModelPreset::Llama3_8b.tensors();
        assert_eq!(t.len(), 291);
        let bytes = manifest_bytes(&t);
        // 8,030,261,248 parameters in bf16.
        assert_eq!(bytes, 8_030_261_248 * 2);
        assert_eq!(format!("{:.2}", bytes as f64 / 1e9), "16.06");
    }

    #[test]
    fn qwen3_0_6b_has_tied_embeddings_and_qk_norms() {
        let t = ModelPreset::Qwen3_0_6b.tensors();
        assert_eq!(t.len(), 1 + 28 * 11 + 1);
        assert!(!t.iter().any(|t| t.name == "lm_head.weight"));
        // 596,049,920 parameters (Qwen3-0.6B without the tied lm_head).
        assert_eq!(manifest_bytes(&t), 596_049_920 * 2);
    }

    #[test]
    fn tiny_is_small() {
        let bytes = manifest_bytes(&ModelPreset::Tiny.tensors());
        assert!(bytes < 4 << 20, "{bytes}");
    }

    #[test]
    fn byte_matrix_folds_trailing_dims() {
        let t = TensorSpec::new("x", DType::F32, vec![3, 4, 5]);
        assert_eq!(t.as_byte_matrix(), (3, 80));
        let v = TensorSpec::new("v", DType::Bf16, vec![7]);
        assert_eq!(v.as_byte_matrix(), (1, 14));
        assert_eq!(v.effective_split(), TpSplit::Replicated);
        assert_eq!(t.effective_split(), TpSplit::Rows);
    }

    #[test]
    fn pipeline_stages_are_contiguous_balanced_and_nonempty() {
        let t = ModelPreset::Llama3_8b.tensors();
        for stages in 1..=8u32 {
            let s = pipeline_stages(&t, stages);
            assert_eq!(s.len(), t.len());
            assert_eq!(s[0], 0);
            assert_eq!(*s.last().unwrap(), stages - 1);
            assert!(s.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1));
            let mut per = vec![0u64; stages as usize];
            for (x, st) in t.iter().zip(&s) {
                per[*st as usize] += x.size_bytes();
            }
            let max = *per.iter().max().unwrap() as f64;
            let mean = per.iter().sum::<u64>() as f64 / stages as f64;
            // The embedding alone is 1 GB of 16: balance within one large tensor of the mean.
            assert!(max <= mean + 1.1e9, "stages={stages} per={per:?}");
        }
        // More stages than tensors still gives each of the first tensors its own stage.
        let few = &t[..3];
        assert_eq!(pipeline_stages(few, 3), vec![0, 1, 2]);
    }
}
