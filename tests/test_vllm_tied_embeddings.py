"""A model whose output layer is its embedding (SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B) on the real vLLM engine: after
a push, vLLM's logprobs are the pushed model's.

vLLM's CPU layers compute through a pre-packed copy of their weight made when the weights are processed; a reload
never loads a tied model's `lm_head.weight`, so without the plugin's refresh the output layer kept its start-up copy
(random under --load-format dummy: every response ran to its maximum length and the reward stayed 0).
    .venv/bin/python -m pytest -q tests/test_vllm_tied_embeddings.py
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from test_vllm_engine import PARAMS, Pusher, hf_logprobs

from mcore_rl.rollout.client import RolloutClient
from mcore_rl.rollout.vllm_config import VLLMConfig
from mcore_rl.rollout.vllm_launcher import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# SmolLM2's architecture (Llama, grouped KV heads, tied embeddings), small; head_dim 32 (vLLM's CPU attention sizes)
TIED_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def tied_model(seed: int) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**TIED_LLAMA)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def test_a_push_reaches_the_tied_output_layer(vllm_venv: VLLMConfig, tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TIED_LLAMA))
    engine = VLLMServer(vllm_venv, str(tmp_path), "float32", "cpu", str(tmp_path / "logs"))
    engine.start()
    client = RolloutClient(engine.url(), engine="vllm", timeout_s=300)
    try:
        for version, seed in ((1, 5), (2, 6)):  # the second push: the refresh is not a one-off of the first
            model = tied_model(seed)
            # what the actor's export sends for a tied model: the embedding, no lm_head.weight (models/rules.py)
            state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
            Pusher(client, engine.url()).push(state, version=version)
            prompt = [5, 9, 13, 2, 7]
            for sample in client.generate_samples([prompt], 2, PARAMS, seed=3):
                expected = hf_logprobs(model, prompt, sample.response_ids)
                gap = max(abs(a - b) for a, b in zip(sample.response_logprobs, expected))
                assert gap < 1e-3, f"push {version}: vLLM's logprobs differ from the pushed model's by {gap:.3g}"
    finally:
        client.close()
        engine.stop()
