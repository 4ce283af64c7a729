"""Write small GGUF files for the tests, the way llama.cpp's converter lays them out.

From a tiny HF model directory (genq_dev.tiny_model) this writes the metadata
llama.cpp uses, the byte-level BPE vocabulary of its tokenizer.json, and the
weights under llama.cpp's names, with Q/K rows interleaved for the llama
architecture. Each tensor is stored in the ggml type `types(name)` picks:
float types and Q4_0..Q8_0 are quantized with the `gguf` package; the
K-quants (which it cannot quantize) get valid random blocks with small finite
scales, so loaders can be compared on them without a quantizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter, quants
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Byte offsets of the fp16 scale fields in each K-quant block.
_K_SCALE_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3"}
_PRE = {"llama": "llama-bpe", "mistral": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def interleave_rotary(values: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: each head's two rotary halves interleaved pair by pair."""
    return values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:]).swapaxes(1, 2).reshape(
        values.shape)


def encode_tensor(values: np.ndarray, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """values in ggml type `kind`: real quantization where `gguf` has one, random valid K-quant blocks otherwise."""
    if kind == Q.F32:
        return values.astype(np.float32)
    if kind not in K_QUANTS:
        return quants.quantize(values.astype(np.float32), kind)
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = values.size // block_values
    raw = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
    for offset in _K_SCALE_FIELDS[kind]:
        scale = rng.uniform(0.001, 0.01, size=blocks).astype(np.float16)
        raw[:, offset : offset + 2] = scale.view(np.uint8).reshape(blocks, 2)
    return raw.reshape(values.shape[0], -1)


def write_gguf(
    model_dir: Path,
    out: Path,
    types: Callable[[str], Q] = lambda name: Q.F32,
    architecture: str | None = None,
    seed: int = 0,
    drop: frozenset[str] = frozenset(),
    control_tokens: dict[int, str] | None = None,
) -> Path:
    """Convert a tiny HF model directory into a GGUF file at out, leaving out the GGUF tensors named in drop;
    control_tokens renames vocabulary ids to special tokens (see _add_tokenizer)."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("rope_scaling"):
        # llama.cpp would write per-dimension factors (rope_freqs.weight), which genq refuses.
        raise ValueError(f"{model_dir} has rope_scaling; make the tiny model with rope_scaling=None")
    arch = architecture or _ARCHITECTURES[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, model_dir, _PRE.get(arch, "default"), control_tokens or {})
    rng = np.random.default_rng(seed)
    weights = load_file(str(model_dir / "model.safetensors"))
    for hf_name, values in weights.items():
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        name = gguf_name(hf_name)
        if name in drop:
            continue
        if arch in ("llama", "mistral") and ".attn_q." in name:
            values = interleave_rotary(values, heads)
        elif arch in ("llama", "mistral") and ".attn_k." in name:
            values = interleave_rotary(values, kv_heads)
        kind = types(name) if values.ndim == 2 else Q.F32
        encoded = encode_tensor(values, kind, rng)
        writer.add_tensor(name, encoded, raw_dtype=kind)
    finish(writer)
    return out


def finish(writer: GGUFWriter) -> None:
    """Write the header, metadata and tensors a GGUFWriter collected, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer: GGUFWriter, model_dir: Path, pre: str, control: dict[int, str]) -> None:
    """The HF directory's byte-level BPE vocabulary as llama.cpp stores one; each id in `control` becomes
    that special token, and merges that spelled its old text are left out."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    for added in tokenizer["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    replaced = {tokens[i] for i in control}
    tokens = [control.get(i, token) for i, token in enumerate(tokens)]
    special |= set(control.values())
    merges = [" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]]
    merges = [m for m in merges if "".join(m.split(" ")) not in replaced and not replaced & set(m.split(" "))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    if config.get("pad_token"):
        writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_add_bos_token(bool(config.get("add_bos_token", False)))
    writer.add_chat_template(config["chat_template"])
