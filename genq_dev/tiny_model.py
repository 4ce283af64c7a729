"""Random-weight Hugging Face model directories for tests and the demo.

make_tiny_model() writes a directory laid out exactly like a real checkpoint of
one of the supported families (config.json, safetensors weights with HF names,
optional sharding + index, tokenizer.json, tokenizer_config.json with a chat
template, generation_config.json), so every loader path in the engine is
exercised without downloading anything. The tokenizer is a real byte-level BPE
trained here on an embedded corpus, so multi-byte characters split across
tokens the way they do in production tokenizers.

Only torch, safetensors and tokenizers are used: transformers is a dev-only
dependency (the correctness reference), never needed to build a model.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# Training text for the BPE tokenizer: English prose, code, markup, numbers, accented
# Latin, Greek, Cyrillic, CJK and emoji, so the learned merges resemble a real
# tokenizer's while rare characters still fall back to single bytes.
_CORPUS = r"""
The quick brown fox jumps over the lazy dog. A message queue decouples the services that produce work from the workers that consume it; when traffic spikes, tasks wait in the broker instead of overwhelming the generator. Each worker drains many requests at once, and every new token is streamed back to the client that asked for it.

Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who repaired watches for everyone in town. Every morning he opened the shutters, brewed a pot of strong coffee, and listened to the ticking of a hundred clocks. "Time is patient," he would say, "but people are not." Children came to watch him work, and he told them stories about the mountains, the rivers, the ships that sailed across the ocean, and the stars that guided them home.

Language models predict the next token given everything that came before. During prefill the model reads the whole prompt in one pass; during decoding it produces one token per step for each sequence in the batch. The key and value vectors of past positions are kept in a cache so that they are not recomputed. A paged cache splits that memory into fixed-size blocks, which lets many sequences of different lengths share the same pool without fragmentation. When two prompts begin with the same system message, their first pages can be shared as well.

Weather report: cloudy in the morning with a chance of light rain in the afternoon. Temperatures between 12 and 18 degrees. Wind from the north-west at 20 km/h. Tomorrow will be sunny and warmer, with highs near 24 degrees.

Recipe for a simple bread: mix 500 g of flour, 10 g of salt, 7 g of dry yeast and 350 ml of warm water. Knead for ten minutes, let the dough rise for an hour, shape it, and bake at 220 degrees for about thirty-five minutes until the crust is golden and sounds hollow when tapped.

Questions and answers. What is the capital of France? Paris. How many days are in a leap year? 366. Who wrote "Pride and Prejudice"? Jane Austen. Why is the sky blue? Because air molecules scatter short wavelengths of sunlight more than long ones.

def fibonacci(n: int) -> list[int]:
    # Return the first n Fibonacci numbers.
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

import json
config = {"model": "tiny", "layers": 2, "hidden_size": 64, "dtype": "float32", "use_cache": True}
with open("config.json", "w", encoding="utf-8") as handle:
    json.dump(config, handle, indent=2)

SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 20;

function greet(name) {
  const message = `Hello, ${name}!`;
  console.log(message);
  return message.length;
}

<html><head><title>Example page</title></head><body><p class="note">Hello world &amp; welcome.</p></body></html>

$ git commit -m "Fix off-by-one error in the scheduler"
$ pip install --upgrade numpy==1.26.4
$ curl -s http://localhost:8000/v1/completions -d '{"prompt": "Hi", "max_tokens": 16}'

Numbers and dates: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536 3.14159 2.71828 1e-6 0x1F 2024-05-17 12:30:45 +33 (0)1 23 45 67 89 #7 50% $19.99 €25,00 £7.50

Le café de la gare est fermé le dimanche, mais la boulangerie à côté ouvre à sept heures. Où est la bibliothèque ? Elle se trouve près de l'église, après le théâtre. Les élèves français étudient l'histoire, la géographie et les mathématiques.

Über den Wolken muss die Freiheit wohl grenzenlos sein. Die Straße führt am Fluss entlang bis zur Brücke. Schöne Grüße aus München und Köln! Der Bäcker backt frühmorgens Brötchen.

El niño comió una manzana en el jardín. ¿Dónde está la estación de tren? ¡Qué día tan bonito! La canción española habla del corazón y de la montaña.

O coração da cidade é a praça, onde as pessoas conversam à tarde. Ação, informação e educação são palavras comuns em português.

Η γλώσσα είναι ζωντανή. Καλημέρα, τι κάνεις; Москва — столица России. Привет, как дела? Спасибо, хорошо.

今天天气很好，我们去公园散步吧。机器学习模型可以生成文本。你好，世界！中文的每个字在UTF-8编码中通常占三个字节。
東京は日本の首都です。私は毎朝コーヒーを飲みます。ありがとうございます。ひらがなとカタカナと漢字。
안녕하세요, 만나서 반갑습니다. 오늘은 날씨가 좋네요. 한국어는 한글로 씁니다.

Emoji and symbols: 😀 😂 🎉 👍 🚀 ❤️ 🌍 🔥 ✨ 🤖 — the robot 🤖 says hi 👋, the rocket 🚀 launches, and the party 🎉 starts. Arrows → ← ↑ ↓, math ∑ ∫ √ ∞ ≈ ≠ ≤ ≥, currency ¥ ₹ ₩, marks © ® ™ § ¶ • … « » “quotes” ‘single’.

Dialogue. "Could you help me write a short poem about the sea?" "Of course. The sea is wide and silver-gray; it sings at night and sleeps by day." "That is lovely, thank you!" "You are welcome. Would you like another verse?" "Yes, please, something about the wind."

A list of things to remember:
- Check the logs before restarting the service.
- Never store passwords in plain text.
- Write tests for every bug you fix.
- Measure performance instead of guessing.
1. Open the file.
2. Read the header.
3. Parse each record and validate its fields.

The history of computing is full of surprising turns. Early machines filled entire rooms and consumed enormous amounts of power, yet they could perform only a few thousand operations per second. Today a phone in your pocket is millions of times faster. Researchers, engineers, and hobbyists built that progress one careful experiment at a time, sharing their results in papers, mailing lists, and open source repositories.

She opened the window and looked at the garden: roses, tulips, sunflowers, and a small apple tree that her grandfather had planted forty years ago. Birds were singing. Somewhere in the distance a train whistled, and a dog barked twice. It was going to be a beautiful summer day.
"""

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# Sizes. "test" keeps unit tests fast; "tiny" (~5M parameters) and "small" (~40M)
# are for the demo and benchmarks; "medium" (~185M: a 1B model's layer widths, 4 layers)
# gives LoRA adapters the size relative to their base that real deployments have. Real vocabularies are far larger, but the
# corpus below cannot support more merges without synthetic filler.
PRESETS: dict[str, dict[str, int]] = {
    "test": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
    },
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "vocab_size": 2048,
        "max_position_embeddings": 4096,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 4096,
        "max_position_embeddings": 8192,
    },
    "medium": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 2048,
        "max_position_embeddings": 4096,
    },
}

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16")}

# Trained first, so their ids are 0..4 in this order (like Llama's <s>=1, </s>=2).
BOS, EOS, IM_START, IM_END, PAD = "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, PAD)
_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)

# ChatML; the Llama/Mistral variant opens with BOS because their tokenizers expect it
# and encode_chat must then not add a second one.
_CHAT_TEMPLATE = r"""{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message['role'] + ' (expected system, user or assistant)') }}
    {%- endif %}
    {%- if message['role'] == 'system' and not loop.first %}
        {{- raise_exception('Only the first message may be a system message') }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Init scales, chosen so a random model behaves like a trained one where tests
# care. Logits get a standard deviation of a few units, so greedy argmax has clear
# margins instead of near-ties. Each residual branch (o_proj, down_proj) writes a
# few times more than the embedding holds, so the final state is not dominated
# by the input embedding (with tied embeddings that would make every token
# predict itself). q/k are scaled up for peaked, content-dependent attention;
# flat attention makes greedy decoding collapse into short loops.
_LOGIT_STD = 4.0
_BRANCH_GAIN = 8.0
_QK_GAIN = 2.0
_NORM_NOISE = 0.1
_BIAS_STD = 0.2


# Pre-tokenizer splits of the released tokenizers: Llama 3 groups digits in threes,
# Qwen2 splits every digit. transformers rebuilds Qwen2's pipeline from this regex
# whatever tokenizer.json says, so the files must use it to agree with it.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _Family:
    """What distinguishes one architecture's checkpoint from another's."""

    architecture: str
    tie_word_embeddings: bool
    add_bos_token: bool
    rope_theta: float
    split_regex: str
    nfc: bool  # Qwen's tokenizer NFC-normalizes its input


_LLAMA = _Family("LlamaForCausalLM", tie_word_embeddings=False, add_bos_token=True, rope_theta=500000.0,
                 split_regex=_LLAMA3_SPLIT, nfc=False)
_QWEN2 = _Family("Qwen2ForCausalLM", tie_word_embeddings=True, add_bos_token=False, rope_theta=1000000.0,
                 split_regex=_QWEN2_SPLIT, nfc=True)
_FAMILY_SPECS: dict[str, _Family] = {
    "llama": _LLAMA,
    "mistral": replace(_LLAMA, architecture="MistralForCausalLM", rope_theta=1000000.0),
    "qwen2": _QWEN2,
    "qwen3": replace(_QWEN2, architecture="Qwen3ForCausalLM"),
}


def model_config(
    family: str = "llama",
    preset: str = "test",
    *,
    dtype: str = "float32",
    vocab_size: int | None = None,
    **config_overrides: Any,
) -> dict[str, Any]:
    """The config.json make_tiny_model() would write, without writing anything."""
    if family not in _FAMILY_SPECS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {tuple(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {tuple(DTYPES)}")
    spec = _FAMILY_SPECS[family]
    size = dict(PRESETS[preset])
    if vocab_size is not None:
        size["vocab_size"] = vocab_size
    if size["vocab_size"] < _MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {_MIN_VOCAB} (256 bytes + the special tokens)")
    config: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": family,
        **size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "torch_dtype": dtype,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if family == "llama":
        # original_max_position_embeddings is tiny so that the llama3 rule rescales
        # some head_dim frequencies, smooths others and keeps the rest at test sizes.
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        config["attention_bias"] = False
        config["mlp_bias"] = False
        config["pretraining_tp"] = 1
    elif family == "mistral":
        config["sliding_window"] = None
    else:
        # Real Qwen configs carry a window but disable it; Qwen2's q/k/v biases are
        # implied by the architecture (no config key), as in the released checkpoints.
        config["use_sliding_window"] = False
        config["sliding_window"] = size["max_position_embeddings"]
        config["max_window_layers"] = size["num_hidden_layers"]
        if family == "qwen3":
            config["attention_bias"] = False
    config.update(config_overrides)
    # Keep derived sizes consistent with overridden ones unless they were given too.
    if "head_dim" not in config_overrides:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if "max_window_layers" in config and "max_window_layers" not in config_overrides:
        config["max_window_layers"] = config["num_hidden_layers"]
    return config


def _weight_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in module order, with its HF name and shape."""
    family = config["model_type"]
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    if family == "qwen2":
        qkv_bias, o_bias = True, False  # hard-wired in the architecture, no config key
    elif family == "mistral":
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
    mlp_bias = family == "llama" and config.get("mlp_bias", False)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        projections = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
        for name, out in projections.items():
            shapes.append((f"{p}.self_attn.{name}_proj.weight", (out, hidden)))
            if qkv_bias:
                shapes.append((f"{p}.self_attn.{name}_proj.bias", (out,)))
        shapes.append((f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim)))
        if o_bias:
            shapes.append((f"{p}.self_attn.o_proj.bias", (hidden,)))
        if family == "qwen3":
            shapes.append((f"{p}.self_attn.q_norm.weight", (head_dim,)))
            shapes.append((f"{p}.self_attn.k_norm.weight", (head_dim,)))
        for name, (out, inp) in {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}.items():
            shapes.append((f"{p}.mlp.{name}_proj.weight", (out, inp)))
            if mlp_bias:
                shapes.append((f"{p}.mlp.{name}_proj.bias", (out,)))
        shapes.append((f"{p}.input_layernorm.weight", (hidden,)))
        shapes.append((f"{p}.post_attention_layernorm.weight", (hidden,)))
    shapes.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def count_parameters(config: dict[str, Any]) -> int:
    """Parameters of the model a config describes (tied embeddings counted once)."""
    return sum(math.prod(shape) for _, shape in _weight_shapes(config))


def _init_tensor(name: str, shape: tuple[int, ...], hidden: int, gen: torch.Generator) -> torch.Tensor:
    """One random tensor, scaled by its role (see _LOGIT_STD and friends)."""
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        # Qwen3 normalizes q and k per head, so their sharpness lives in these weights.
        return _QK_GAIN * (1.0 + _NORM_NOISE * noise)
    if name.endswith("norm.weight"):
        return 1.0 + _NORM_NOISE * noise
    if name.endswith(".bias"):
        return _BIAS_STD * noise
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        # The final RMSNorm gives unit-RMS hidden states, so logits have std
        # std(row) * sqrt(hidden); a tied embedding shares that scale.
        return noise * (_LOGIT_STD / math.sqrt(hidden))
    gain = 1.0
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        gain = _BRANCH_GAIN
    elif name.endswith(("q_proj.weight", "k_proj.weight")):
        gain = _QK_GAIN
    return noise * (gain / math.sqrt(shape[1]))


def _random_weights(config: dict[str, Any], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Deterministic weights: one generator, tensors drawn in module order."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: _init_tensor(name, shape, config["hidden_size"], gen).to(dtype).contiguous()
        for name, shape in _weight_shapes(config)
    }


def _shard_assignment(sizes: list[int], num_shards: int) -> list[int]:
    """Shard index per tensor: contiguous, balanced by bytes, no shard left empty."""
    if not 1 <= num_shards <= len(sizes):
        raise ValueError(f"num_shards must be between 1 and the number of tensors ({len(sizes)})")
    total, done, prev, out = sum(sizes), 0, -1, []
    for i, size in enumerate(sizes):
        by_bytes = done * num_shards // total
        prev = min(prev + 1, max(by_bytes, num_shards - (len(sizes) - i)))
        out.append(prev)
        done += size
    return out


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    # safetensors creates the file owner-only; a checkpoint is meant to be shared (e.g. into a container).
    path.chmod(0o644)


def _write_weights(out: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    """model.safetensors, or HF-style shards plus model.safetensors.index.json."""
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if num_shards == 1:
        _save_safetensors(weights, out / "model.safetensors")
        return
    names = list(weights)
    assignment = _shard_assignment([weights[n].nbytes for n in names], num_shards)
    weight_map: dict[str, str] = {}
    for shard in range(num_shards):
        filename = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n, s in zip(names, assignment, strict=True) if s == shard}
        _save_safetensors(part, out / filename)
        weight_map.update(dict.fromkeys(part, filename))
    index = {
        "metadata": {
            "total_parameters": sum(t.numel() for t in weights.values()),
            "total_size": sum(t.nbytes for t in weights.values()),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(out / "model.safetensors.index.json", index)


def _filler_words(count: int) -> list[str]:
    """Deterministic pseudo-words that give BPE more to merge than the corpus alone."""
    rng = random.Random(0)
    onsets = ["b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p", "pl"]
    onsets += ["qu", "r", "s", "sh", "st", "t", "th", "tr", "v", "w", "z"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
    codas = ["", "", "n", "r", "s", "l", "m", "st", "nd", "ck"]
    return [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(2, 4)))
        for _ in range(count)
    ]


def _train_bpe(vocab_size: int, texts: list[str], spec: _Family) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    if spec.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec.split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def train_tokenizer(vocab_size: int, family: str = "llama") -> Tokenizer:
    """A byte-level BPE with exactly vocab_size tokens (special tokens included).

    The embedded corpus supports ~2300 tokens; larger vocabularies add pseudo-word
    filler until the trainer can reach the size, so tokenizer and embedding
    matrix always agree (no unreachable logits).
    """
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {_MIN_VOCAB}")
    spec = _FAMILY_SPECS[family]
    filler = 0
    while True:
        texts = [_CORPUS]
        if filler:
            texts.append(" ".join(_filler_words(filler)))
        tokenizer = _train_bpe(vocab_size, texts, spec)
        deficit = vocab_size - tokenizer.get_vocab_size()
        if deficit <= 0:
            break
        if filler > 64 * vocab_size:
            raise RuntimeError(f"could not train a {vocab_size}-token BPE vocabulary")
        filler += deficit // 2 + 64
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise RuntimeError(f"special token {token} did not get id {expected_id}")
    bos_id = SPECIAL_TOKENS.index(BOS)
    if spec.add_bos_token:
        # Llama 3's layout: byte-level offsets, then a template that prepends BOS.
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
                ),
            ]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _tokenizer_config(family: str, max_len: int) -> dict[str, Any]:
    spec = _FAMILY_SPECS[family]
    template = ("{{- bos_token }}\n" if spec.add_bos_token else "") + _CHAT_TEMPLATE
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    added = {str(i): {"content": token, **flags} for i, token in enumerate(SPECIAL_TOKENS)}
    return {
        "add_bos_token": spec.add_bos_token,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": max_len,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Explicitly none: transformers' Qwen2Tokenizer would otherwise add "<|endoftext|>".
        "unk_token": None,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(out_dir: str | Path, vocab_size: int, family: str = "llama", max_len: int = 2048) -> Path:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json
    for a vocab_size-token BPE in `family`'s style. make_tiny_model() uses it;
    so can a checkpoint written by other means (e.g. transformers' own random
    init in the tests) that needs a real tokenizer beside it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size, family)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(family, max_len))
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": SPECIAL_TOKENS.index(BOS),
            "eos_token_id": [SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(IM_END)],
        },
    )
    return out


def make_tiny_model(
    out_dir: str | Path,
    family: str = "llama",
    preset: str = "test",
    *,
    seed: int = 0,
    dtype: str = "float32",
    num_shards: int = 1,
    vocab_size: int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight HF checkpoint directory and return its path.

    config_overrides replace config.json keys (e.g. tie_word_embeddings=False,
    num_hidden_layers=3, rope_scaling=None); the weights follow the final config.
    Same arguments -> byte-identical files.
    """
    config = model_config(family, preset, dtype=dtype, vocab_size=vocab_size, **config_overrides)
    out = Path(out_dir)
    write_tokenizer_files(out, config["vocab_size"], family, config["max_position_embeddings"])
    _write_json(out / "config.json", config)
    _write_weights(out, _random_weights(config, seed, DTYPES[dtype]), num_shards)
    return out
