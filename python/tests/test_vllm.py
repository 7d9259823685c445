"""RlplaneWorkerExtension inside real vLLM. Skips, saying why, where vLLM cannot be imported.

Where it can: builds a tiny random Llama locally (no download), starts vLLM with the extension,
and checks that vLLM accepted it (the methods answer through collective_rpc). Loading weights
from a sidecar is exercised by test_integration.py's engine script when RLPLANE_VLLM_TEST is set.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: not here
    print(f"SKIPPED test_vllm.py: vllm not importable: {e!r}", file=sys.stderr)
    pytest.skip(f"vllm not importable: {e!r}", allow_module_level=True)

import rlplane  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers", reason="building a tiny model needs transformers")
    torch = pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("tiny-llama")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    # a trivial tokenizer so vLLM starts without a hub
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)} | {"[UNK]": 0}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(d)
    except ImportError as e:
        pytest.skip(f"tokenizers not importable: {e!r}")
    return d


def test_vllm_accepts_the_extension(tiny_llama: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        print("SKIPPED test_vllm_accepts_the_extension: no CUDA device", file=sys.stderr)
        pytest.skip("vLLM's GPU workers need a CUDA device")
    from vllm import LLM

    llm = LLM(model=str(tiny_llama), worker_extension_cls="rlplane.vllm.RlplaneWorkerExtension",
              enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=128)
    # Not connected: the extension's own error comes back through collective_rpc.
    with pytest.raises(Exception, match="rlplane_connect"):
        llm.collective_rpc("rlplane_version")
    assert rlplane.vllm.RlplaneWorkerExtension.rlplane_update_weights.__name__ == "rlplane_update_weights"
