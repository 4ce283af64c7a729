"""RoPE tables against transformers' own rotary embedding modules, for every
scaling and the variants of their parameters the parity tests do not reach
(YaRN's mscale and truncate, explicit attention factors, partial rotary).

Length-dependent scalings (dynamic NTK, LongRoPE) are compared with
transformers fed one position per call in increasing order, the way it runs
during token-by-token decoding; the engine computes every position at once,
in any order (see engine/rope.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from engine.config import ModelConfig, RopeConfig
from engine.rope import RotaryEmbedding

SIZE = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
POSITIONS = 80


def _yarn(**extra: object) -> dict:
    params = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}
    return {"max_position_embeddings": 128, "rope_parameters": {**params, **extra}}


def _longrope(**extra: object) -> dict:
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [3.0, 5.0, 7.0, 11.0]}
    return {"max_position_embeddings": 256, "original_max_position_embeddings": 32,
            "rope_parameters": {**params, **extra}}


CASES = {
    "linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0}}),
    "llama3": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64}}),
    "dynamic": ("LlamaConfig", {"max_position_embeddings": 24,
                                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "yarn": ("Qwen3Config", _yarn()),
    "yarn-no-truncate-betas": ("Qwen3Config", _yarn(truncate=False, beta_fast=16, beta_slow=2)),
    "yarn-mscale": ("LlamaConfig", _yarn(mscale=0.707, mscale_all_dim=1.0)),
    "yarn-attention-factor": ("LlamaConfig", _yarn(attention_factor=0.8)),
    "longrope-partial": ("Phi3Config", _longrope()),
    "longrope-attention-factor": ("Phi3Config", _longrope(attention_factor=1.3, factor=2.0)),
    "default-partial": ("Phi3Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.75}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cos_sin_match_transformers(case: str):
    config_class, options = CASES[case]
    hf_config = getattr(transformers, config_class)(**SIZE, **options)
    rotary_class = Phi3RotaryEmbedding if config_class == "Phi3Config" else LlamaRotaryEmbedding
    hf = rotary_class(hf_config)
    raw = {**SIZE, **options, "architectures": [config_class.replace("Config", "ForCausalLM")]}
    config = ModelConfig.from_dict(raw)
    ours = RotaryEmbedding(config.rope, config.head_dim)
    x = torch.zeros(1, dtype=torch.float32)
    rope_type = config.rope.rope_type
    if rope_type in ("dynamic", "longrope"):
        # one position per forward, from 0: transformers' state follows the running length
        pairs = [hf(x, torch.tensor([[p]])) for p in range(POSITIONS)]
        want_cos = torch.cat([c[0] for c, _ in pairs])
        want_sin = torch.cat([s[0] for _, s in pairs])
    else:
        want_cos, want_sin = (t[0] for t in hf(x, torch.arange(POSITIONS).unsqueeze(0)))
    order = torch.randperm(POSITIONS, generator=torch.Generator().manual_seed(0))
    cos, sin = ours(order)  # any order: a token's rotation depends on its own position only
    inverse = torch.argsort(order)
    # angles reach 80 rad, where one fp32 ulp is 7.6e-6: a last-bit difference in a frequency shows at ~1e-6
    torch.testing.assert_close(cos[inverse], want_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin[inverse], want_sin, atol=1e-5, rtol=0)
    assert cos.shape[-1] == config.rope.rotary_dim(config.head_dim)
    if config.rope.rope_type != "default":  # the scaling changed the table
        plain = RopeConfig(theta=config.rope.theta, partial_rotary_factor=config.rope.partial_rotary_factor)
        assert not torch.allclose(cos, RotaryEmbedding(plain, config.head_dim)(order)[0], atol=1e-3)
