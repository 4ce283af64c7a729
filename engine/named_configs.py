"""A few well-known models' config.json contents, so `genq plan` can size them with nothing
downloaded. Only the fields engine/config.py reads; the values are those of the models' published
config.json files on the Hugging Face Hub (meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-7B,
google/gemma-2-9b, mistralai/Mixtral-8x7B-v0.1)."""

from __future__ import annotations

from typing import Any

NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 14336,
        "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "vocab_size": 256000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "float32",
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
        "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}
