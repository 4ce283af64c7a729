"""LoRA adapters (issue 28) against PEFT applied to transformers: random adapters PEFT itself
initialises (init_lora_weights=False: B is not zero) and saves, on tiny random models of three
families. Greedy tokens and logits of batches mixing two adapters and the base model; PEFT's
scalings (lora_alpha, rsLoRA, rank and alpha patterns); prefix pages shared within an adapter
only; every bad adapter refused naming its problem; adapters registered and unregistered between
steps."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import llguidance
import llguidance.torch
import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import Constraint, Generator, Job
from engine.cache import ROOT_HASH, KVCache, page_hash
from engine.errors import AdapterLoadError, JobRejected
from engine.lora import LoraBatch, LoraSlots, load_adapter
from engine.quantized_linear import quantize_weight
from engine.weights import load_model
from tests.engine_runs import run
from tests.lora_adapters import save_peft_adapter, truncate_adapter
from tests.test_engine_vs_transformers import VARIANTS, hf_greedy, model_dir, run_forward
from tests.test_speculative import repetitive_prompts

PAGE_SIZE = 8
# Gemma 2 (transformers-initialised): sandwich norms, gelu-tanh, soft-capping, sliding layers
FAMILIES = ("llama", "qwen2", "gemma2")
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig options: every projection with alpha / r; rsLoRA on a few, with rank and alpha patterns
ADAPTERS: dict[str, dict[str, object]] = {
    "full": {"r": 8, "lora_alpha": 16, "target_modules": ALL_TARGETS},
    "rs": {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj", "down_proj"],
           "rank_pattern": {"down_proj": 6}, "alpha_pattern": {"v_proj": 3}},
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_dirs(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path],
                hf_model_factory: Callable[..., Path],
                tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """(base model dir, adapter name -> adapter dir) of one family."""
    variant = next(v for v in VARIANTS if v.name == request.param)
    base = model_dir(variant, tiny_model_factory, hf_model_factory)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = {name: save_peft_adapter(base, root / name, seed, **options)
                for seed, (name, options) in enumerate(ADAPTERS.items())}
    return base, adapters


@pytest.fixture(scope="module")
def peft_model(family_dirs: tuple[Path, dict[str, Path]]) -> PeftModel:
    """Both adapters loaded into one PeftModel over transformers' base model (set_adapter picks)."""
    base_dir, adapters = family_dirs
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def peft_greedy(model: PeftModel, adapter: str | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    """PEFT's greedy tokens with `adapter` (None: the base model, adapters disabled)."""
    with torch.inference_mode():
        if adapter is None:
            with model.disable_adapter():
                return hf_greedy(model, prompt, max_new_tokens)
        model.set_adapter(adapter)
        return hf_greedy(model, prompt, max_new_tokens)


def generator_with_adapters(base_dir: Path, adapters: dict[str, Path], **options: object) -> Generator:
    generator = Generator.from_pretrained(base_dir, cache_tokens=2048, page_size=PAGE_SIZE, max_chunk_size=64,
                                          **options)
    for name, path in adapters.items():
        generator.adapters.register(name, path)
    return generator


@pytest.mark.parametrize("speculation", ["plain", "ngram", "draft-model"])
def test_mixed_batch_greedy_tokens_equal_peft(family_dirs: tuple[Path, dict[str, Path]], peft_model: PeftModel,
                                              speculation: str) -> None:
    """With n-gram drafts, and with a draft model (the base model itself, run without the adapters)."""
    base_dir, adapters = family_dirs
    options: dict[str, object] = {"plain": {}, "ngram": {"use_ngram_draft": True},
                                  "draft-model": {"draft_model_path": base_dir, "num_draft_tokens": 3}}[speculation]
    generator = generator_with_adapters(base_dir, adapters, **options)
    choices: list[str | None] = [*adapters, None]
    prompts = repetitive_prompts()  # repeated phrases give the n-gram drafter something to propose
    jobs = [Job(prompt, 16, stop_conditions=[], identifier=i, adapter=choices[i % len(choices)])
            for i, prompt in enumerate(prompts)]
    finals = run(generator, jobs)
    changed = 0
    for i, prompt in enumerate(prompts):
        adapter = choices[i % len(choices)]
        expected = peft_greedy(peft_model, adapter, prompt, 16)
        assert finals[i].completion_ids == expected, f"job {i} ({adapter})"
        changed += adapter is not None and expected != peft_greedy(peft_model, None, prompt, 16)
    assert changed == 4, "every adapter job's tokens differ from the base model's"
    assert (generator.stats.drafted_tokens > 0) == (speculation != "plain")


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_base_weights_with_adapters_equal_peft_over_the_same_weights(
        family_dirs: tuple[Path, dict[str, Path]], quantize: str) -> None:
    """The delta is added to whatever the quantized base linear computes: PEFT over a transformers
    model holding the engine's dequantized projection weights gives the same greedy tokens."""
    base_dir, adapters = family_dirs
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rsplit(".", 1)[-1] in ALL_TARGETS:
                module.weight.copy_(quantize_weight(module.weight, quantize).dequantize())
    reference = PeftModel.from_pretrained(hf, adapters["full"], adapter_name="full").eval()
    generator = generator_with_adapters(base_dir, {"full": adapters["full"]}, quantize=quantize)
    vocab = generator.model.config.vocab_size
    rng = random.Random(8)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (4, 13, 9)]
    choices = ["full", None, "full"]
    finals = run(generator, [Job(prompt, 8, stop_conditions=[], identifier=i, adapter=choices[i])
                             for i, prompt in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert finals[i].completion_ids == peft_greedy(reference, choices[i], prompt, 8), f"job {i}"


def peft_constrained_greedy(model: PeftModel, adapter: str, prompt: list[int], pattern: str,
                            generator: Generator, max_new_tokens: int) -> list[int]:
    """PEFT's greedy tokens with `adapter`, each step's argmax taken over the tokens llguidance's own
    matcher allows for the regex (full forwards; the engine's constraint code is not used)."""
    tokenizer = llguidance.LLTokenizer(generator.tokenizer.backend.to_str(), n_vocab=generator.model.config.vocab_size)
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_regex(pattern))
    bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
    model.set_adapter(adapter)
    tokens: list[int] = []
    with torch.inference_mode():
        while len(tokens) < max_new_tokens and not matcher.is_stopped():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1:, :tokenizer.vocab_size].clone()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
            llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
            tokens.append(int(logits[0].argmax()))
            assert matcher.consume_token(tokens[-1])
    return tokens


def test_adapter_jobs_with_a_constraint_equal_peft_under_the_grammars_mask(
        family_dirs: tuple[Path, dict[str, Path]], peft_model: PeftModel) -> None:
    """A constrained job with an adapter, batched beside unconstrained and base-model jobs: its greedy
    tokens are PEFT's argmax over the tokens the grammar allows, step by step."""
    base_dir, adapters = family_dirs
    generator = generator_with_adapters(base_dir, adapters)
    pattern = "[a-z]{1,6}( [a-z]{1,6}){0,3}"
    rng = random.Random(11)
    vocab = generator.model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (6, 11, 9)]
    jobs = [Job(prompts[0], 10, stop_conditions=[], identifier=0, adapter="full", constraint=Constraint.regex(pattern)),
            Job(prompts[1], 10, stop_conditions=[], identifier=1, adapter="rs", constraint=Constraint.regex(pattern)),
            Job(prompts[2], 10, stop_conditions=[], identifier=2)]
    finals = run(generator, jobs)
    for i, adapter in ((0, "full"), (1, "rs")):
        assert finals[i].completion_ids == peft_constrained_greedy(peft_model, adapter, prompts[i], pattern,
                                                                   generator, 10), f"job {i}"
    assert finals[2].completion_ids == peft_greedy(peft_model, None, prompts[2], 10)


@pytest.mark.parametrize("cache_dtype", ["fp8", "q8", "k8v4"])
def test_adapters_with_a_quantized_kv_cache_batch_as_they_run_alone(
        family_dirs: tuple[Path, dict[str, Path]], peft_model: PeftModel, cache_dtype: str) -> None:
    """A quantized KV cache stores what the projections (adapters included) computed: a batch mixing
    two adapters and the base model gives each job the tokens it gets alone on the same cache, and
    the adapters' tokens are not the base model's."""
    base_dir, adapters = family_dirs
    choices: list[str | None] = ["full", "rs", None]
    rng = random.Random(5)
    prompts = [[rng.randrange(200) for _ in range(n)] for n in (5, 12, 7)]

    def jobs(indices: list[int]) -> list[Job]:
        return [Job(prompts[i], 12, stop_conditions=[], identifier=i, adapter=choices[i]) for i in indices]

    batched = run(generator_with_adapters(base_dir, adapters, cache_dtype=cache_dtype), jobs([0, 1, 2]))
    for i in range(3):
        alone = run(generator_with_adapters(base_dir, adapters, cache_dtype=cache_dtype), jobs([i]))
        assert batched[i].completion_ids == alone[i].completion_ids, f"job {i} ({choices[i]})"
    for i in (0, 1):
        assert batched[i].completion_ids != peft_greedy(peft_model, None, prompts[i], 12), f"job {i}"


@pytest.mark.parametrize("layout", ["per-group", "stacked-slots"])
def test_mixed_forward_logits_within_1e4_of_peft(family_dirs: tuple[Path, dict[str, Path]],
                                                 peft_model: PeftModel, layout: str) -> None:
    """One forward whose rows run the two adapters and the base model, interleaved: the product per
    adapter, and the batched one over stacked slots (ranks 8 and 4/6 padded to the widest, the rs
    adapter's untargeted linears zero, groups padded to the longest, a spare adapter in slot 0 so
    the step's slots are gathered)."""
    base_dir, adapter_dirs = family_dirs
    model = load_model(base_dir)
    loaded = {name: load_adapter(path, model.config, name, torch.float32, "cpu") for name, path in adapter_dirs.items()}
    slots = None
    if layout == "stacked-slots":
        slots = LoraSlots()
        spare = load_adapter(adapter_dirs["full"], model.config, "spare", torch.float32, "cpu")
        assert slots.slot(spare) == 0
    cache = KVCache.allocate(model.config, 64, PAGE_SIZE, torch.float32, "cpu")
    rng = random.Random(1)
    lengths = [5, PAGE_SIZE + 1, 3, 20, 12, 1]
    choices: list[str | None] = [*loaded, None]
    names = [choices[i % len(choices)] for i in range(len(lengths))]
    seqs = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in lengths]
    pages = iter(range(64))
    tables = [[next(pages) for _ in range(-(-n // PAGE_SIZE))] for n in lengths]
    lora = LoraBatch.build([(loaded[name] if name else None, n) for name, n in zip(names, lengths, strict=True)],
                           torch.device("cpu"), slots)
    assert lora is not None
    if slots is not None:
        assert lora.segments is not None and lora.segments.valid is not None, "the batched layout, padded"
    with torch.inference_mode():
        logits = run_forward(model, cache, seqs, tables, [0] * len(seqs), lengths, lora)
        for row, (name, tokens) in enumerate(zip(names, seqs, strict=True)):
            if name is None:
                with peft_model.disable_adapter():
                    expected = peft_model(torch.tensor([tokens])).logits[0, -1]
            else:
                peft_model.set_adapter(name)
                expected = peft_model(torch.tensor([tokens])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=0)


def test_scalings_are_peft_alpha_and_rslora(family_dirs: tuple[Path, dict[str, Path]], peft_model: PeftModel) -> None:
    """Each targeted module's scaling is PEFT's own: lora_alpha / r, lora_alpha / sqrt(r) with
    use_rslora, r and lora_alpha per module from rank_pattern and alpha_pattern."""
    base_dir, adapter_dirs = family_dirs
    config = load_model(base_dir).config
    for name, path in adapter_dirs.items():
        adapter = load_adapter(path, config, name, torch.float32, "cpu")
        expected = {module.removeprefix("base_model.model."): layer.scaling[name]
                    for module, layer in peft_model.named_modules()
                    if isinstance(layer, LoraLayer) and name in layer.scaling}
        assert adapter.scalings == pytest.approx(expected)
    rs = load_adapter(adapter_dirs["rs"], config, "rs", torch.float32, "cpu")
    assert rs.scalings["model.layers.0.self_attn.q_proj"] == pytest.approx(8 / 4**0.5)
    assert rs.scalings["model.layers.0.self_attn.v_proj"] == pytest.approx(3 / 4**0.5)
    assert rs.scalings["model.layers.0.mlp.down_proj"] == pytest.approx(8 / 6**0.5)


def test_prefix_pages_shared_within_an_adapter_never_across(family_dirs: tuple[Path, dict[str, Path]]) -> None:
    base_dir, adapters = family_dirs
    generator = generator_with_adapters(base_dir, adapters)
    prompt = [random.Random(5).randrange(generator.model.config.vocab_size) for _ in range(5 * PAGE_SIZE)]
    full_pages = (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE

    def cached(adapter: str | None) -> int | None:
        return run(generator, [Job(prompt, 2, stop_conditions=[], identifier=0, adapter=adapter)])[0].cached_tokens

    assert [cached("full"), cached("full"), cached("rs"), cached(None), cached("rs"), cached(None)] == \
        [0, full_pages, 0, 0, full_pages, full_pages]
    first_page = prompt[:PAGE_SIZE]
    digests = {name: generator.adapters.resolve(name).digest for name in adapters}
    roots = [ROOT_HASH, *digests.values()]
    assert len(set(roots)) == len(roots)
    assert all(generator.pool.lookup(page_hash(root, first_page)) is not None for root in roots)


def test_register_and_unregister_between_steps(family_dirs: tuple[Path, dict[str, Path]],
                                               peft_model: PeftModel) -> None:
    """A running job keeps the adapter it started with when its name is unregistered and registered
    again with other weights; a job for an unregistered name is refused at enqueue."""
    base_dir, adapters = family_dirs
    generator = generator_with_adapters(base_dir, {"tuned": adapters["full"]})
    prompt = list(range(3, 14))
    generator.enqueue(Job(prompt, 12, stop_conditions=[], identifier="old", adapter="tuned"))
    finals = {}
    for _ in range(3):
        finals.update({r.identifier: r for r in generator.iterate() if r.eos})
    generator.adapters.unregister("tuned")
    with pytest.raises(JobRejected, match="adapter 'tuned' is not registered"):
        generator.enqueue(Job(prompt, 12, adapter="tuned"))
    generator.adapters.register("tuned", adapters["rs"])
    with pytest.raises(AdapterLoadError, match="adapter 'tuned' is already registered"):
        generator.adapters.register("tuned", adapters["full"])
    finals.update(run(generator, [Job(prompt, 12, stop_conditions=[], identifier="new", adapter="tuned")]))
    assert finals["old"].completion_ids == peft_greedy(peft_model, "full", prompt, 12)
    assert finals["new"].completion_ids == peft_greedy(peft_model, "rs", prompt, 12)
    assert generator.adapters.names() == ["tuned"]


# -- bad adapters ----------------------------------------------------------------------------


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    tensors = load_file(path / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, path / "adapter_model.safetensors")
    return path


def _reshape_one(tensors: dict[str, torch.Tensor]) -> None:
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[key] = torch.randn(tensors[key].shape[0], tensors[key].shape[1] + 1)


def _without_weights(path: Path) -> Path:
    (path / "adapter_model.safetensors").unlink()
    return path


def _edit_config(path: Path, **changes: object) -> Path:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return path


BAD_ADAPTERS: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "shape-mismatch": (lambda base, out: _edit_tensors(save_peft_adapter(base, out, 0, r=4, target_modules=["q_proj"]),
                                                       _reshape_one), r"q_proj\.lora_A has shape"),
    "unknown-target": (lambda base, out: save_peft_adapter(base, out, 0, r=4, target_modules=["q_proj", "lm_head"]),
                       "unknown target module.*lm_head"),
    "unknown-target-regex": (lambda base, out: save_peft_adapter(base, out, 0, r=4, target_modules=r".*lm_head"),
                             r"tensor 'base_model\.model\.lm_head\.\w+\.weight' is not a LoRA A/B weight of a "
                             r"decoder layer's projection"),
    "rank-too-large": (lambda base, out: save_peft_adapter(base, out, 0, r=72, target_modules=["v_proj"]),
                       "rank 72 exceeds the maximum LoRA rank 64"),
    "truncated-file": (lambda base, out: truncate_adapter(save_peft_adapter(base, out, 0, r=4,
                                                                             target_modules=["q_proj"])),
                       "truncated or not a safetensors file"),
    "missing-file": (lambda base, out: _without_weights(save_peft_adapter(base, out, 0, r=4,
                                                                          target_modules=["q_proj"])),
                     "adapter_model.safetensors: unreadable"),
    "dora": (lambda base, out: save_peft_adapter(base, out, 0, r=4, target_modules=["q_proj"], use_dora=True),
             r"DoRA \(use_dora\) is not supported"),
    "bias": (lambda base, out: save_peft_adapter(base, out, 0, r=4, target_modules=["q_proj"], bias="lora_only"),
             "bias='lora_only' is not supported"),
    "not-lora": (lambda base, out: _edit_config(save_peft_adapter(base, out, 0, r=4, target_modules=["q_proj"]),
                                                peft_type="IA3"), "peft_type 'IA3' is not supported"),
}


@pytest.mark.parametrize("case", list(BAD_ADAPTERS), ids=list(BAD_ADAPTERS))
def test_bad_adapter_refused_with_its_problem(case: str, tiny_model_factory: Callable[..., Path],
                                              tmp_path: Path) -> None:
    base = tiny_model_factory("llama")
    make, message = BAD_ADAPTERS[case]
    out = tmp_path / case
    out.mkdir()
    path = make(base, out)
    generator = Generator.from_pretrained(base, cache_tokens=256, page_size=PAGE_SIZE)
    with pytest.raises(AdapterLoadError, match=message):
        generator.adapters.register("bad", path)
    assert "bad" not in generator.adapters
