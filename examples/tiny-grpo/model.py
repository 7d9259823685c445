"""The policy: a tiny causal transformer language model.

It is built to have few parameter tensors (16 with the default two layers): no biases, RMSNorm
with a weight only, and the attention's query/key/value projections fused into one matrix. An
RLJob lists every tensor the trainer sends to the engines by name, dtype and shape
(`spec.model.tensors`), so a short list keeps the manifest readable; `python model.py` prints it.
"""

import torch
import torch.nn.functional as F
from torch import nn

import task


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp_in = nn.Linear(dim, 4 * dim, bias=False)
        self.mlp_out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        # [b, t, d] -> [b, heads, t, d / heads]
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok_emb = nn.Embedding(task.VOCAB_SIZE, dim)
        self.pos_emb = nn.Embedding(task.MAX_SEQ_LEN, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, task.VOCAB_SIZE, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, time] int64 -> next-token logits [batch, time, vocab]."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def manifest(model: nn.Module) -> list[dict]:
    """The model's tensors as rlplane's manifest lists them, in `named_parameters()` order (the
    order refit sends them). Every parameter is float32."""
    out = []
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, f"{name} is {p.dtype}; the manifest says f32"
        out.append({"name": name, "dtype": "f32", "shape": list(p.shape)})
    return out


def manifest_yaml(model: nn.Module, indent: int = 0) -> str:
    """The manifest as YAML for `spec.model.tensors`."""
    pad = " " * indent
    lines = []
    for t in manifest(model):
        lines.append(f"{pad}- name: {t['name']}")
        lines.append(f"{pad}  dtype: {t['dtype']}")
        lines.append(f"{pad}  shape: [{', '.join(str(d) for d in t['shape'])}]")
    return "\n".join(lines)


if __name__ == "__main__":
    m = TinyLM()
    n = sum(p.numel() for p in m.parameters())
    print(f"# TinyLM: {len(list(m.parameters()))} tensors, {n} parameters ({4 * n} bytes in f32)")
    print(manifest_yaml(m))
