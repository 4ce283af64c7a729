"""Turn a validated wire request into an engine Job (on the task thread, so
tokenization runs in parallel with the engine loop). A chat is rendered by
producer/chat_rendering.py (the gateway's POST /tokenize renders with the same)
with the tools (docs/tools.md), and its calls (forced, or chosen under "auto")
become the job's constraint."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import fields
from functools import lru_cache

from engine import Constraint, Embedding, Job, SamplerSettings, Tokenizer
from engine.constraints import compiled_grammar
from engine.vision.images import ImagePrompt
from producer.chat_rendering import model_reasoning_format, model_tool_format, render_messages
from producer.protocol import (
    DRY_DEFAULT_SEQUENCE_BREAKERS,
    XTC_SPARED,
    GenerationRequest,
    NamedToolChoice,
    OutputConstraint,
    ProtocolError,
    SamplingParams,
    grammar_source,
)
from producer.tool_calls import SPECIAL_MARKERS, ToolChoice, auto_call_grammar, forced_call_grammar


def build_job(request: GenerationRequest, tokenizer: Tokenizer, identifier: str, vocab_size: int,
              images: Sequence[Embedding] = (), image_prompt: ImagePrompt | None = None) -> Job:
    """The engine job for `request`. `vocab_size` is the model's: the protocol bounds token ids
    only by int32, so stop tokens the model can never produce are refused here (the engine
    refuses such input_ids, sampling settings refuse such banned ids and biases). Whether the
    prompt and max_new_tokens fit the model is the engine's admission check (JobRejected).

    A request with tools gets its tool_format filled in when it left it null (the format this
    model writes): the same request object goes on to the loop, whose RequestEvents reads the
    calls out of the output in that format (worker/tool_results.py). A chat gets its
    reasoning_format filled in so too (the thought is split off first).

    `images`: the request's image embeddings in prompt order (worker/images.py); each image
    placeholder of the prompt is expanded as the model's HF processor does (`image_prompt`:
    Gemma 3's newlines, soft tokens and <end_of_image>) and its image tokens become the
    embedding's reserved ids."""
    for index, token in enumerate(request.stop_token_ids):
        if token >= vocab_size:
            raise ProtocolError([f"stop_token_ids[{index}]: token id {token} is outside the vocabulary "
                                 f"[0, {vocab_size})"])
    if request.tools is not None and request.tool_format is None:
        request.tool_format = model_tool_format(tokenizer.chat)
    if request.messages is not None and request.reasoning_format is None:
        request.reasoning_format = model_reasoning_format(tokenizer.chat)
    expand = image_prompt if images else None
    if request.prompt is not None:
        add_bos = tokenizer.add_bos_token if request.add_bos is None else request.add_bos
        text = expand.expand_text(request.prompt) if expand else request.prompt
        input_ids = tokenizer.encode(text, add_special_tokens=add_bos)
        if not input_ids:
            raise ProtocolError(["prompt: encodes to no tokens"])
    elif request.messages is not None:
        if tokenizer.chat_template is None:
            raise ProtocolError(["messages: this model has no chat template; send prompt or input_ids"])
        input_ids = encode_messages(request, tokenizer, expand)
    else:
        input_ids = list(request.input_ids or ())
        if expand:
            input_ids = expand.expand_tokens(input_ids, tokenizer)
    if expand:
        try:
            input_ids = expand.place(input_ids, images)
        except ValueError as error:
            raise ProtocolError([f"{'prompt' if request.prompt is not None else 'messages'}: {error}"]) from None
    stops: list[int | str] = [*request.stop, *request.stop_token_ids]
    if not request.ignore_eos:
        stops += tokenizer.eos_token_ids
    return Job(
        input_ids,
        stop_conditions=stops,
        gen_settings=sampler_settings(request.sampling, tokenizer, vocab_size),
        identifier=identifier,
        seed=request.sampling.seed,
        constraint=(tool_constraint(request, tokenizer) if request.constraint is None
                    else engine_constraint(request.constraint)),
        # The queue's priority orders admission in the engine too (0 = most urgent; none = 0, as on the broker).
        priority=request.priority or 0,
        embeddings=images,
        **{name: getattr(request, name) for name in JOB_SAME_NAMED},
    )


def encode_messages(request: GenerationRequest, tokenizer: Tokenizer,
                    image_prompt: ImagePrompt | None = None) -> list[int]:
    """The chat's prompt tokens (render_messages, encoded): with image_prompt, each image placeholder
    expanded as the model's processor expands it before encoding."""
    if image_prompt is None:
        return tokenizer.encode_rendered(render_messages(request, tokenizer.chat))
    text = render_messages(request, tokenizer.chat, image_prompt.placeholder)
    return tokenizer.encode_rendered(image_prompt.expand_text(text))


def tool_constraint(request: GenerationRequest, tokenizer: Tokenizer) -> Constraint | None:
    """The grammar of the request's tool calls in its tool format (docs/tools.md): a forced call
    (tool_choice "required" or a named function) from the output's start; under "auto" (or no
    choice) free text until the output commits to a call, then the call; "none" leaves the
    output free."""
    choice = request.tool_choice
    if request.tools is None or choice == "none":
        return None
    assert request.tool_format is not None, "build_job resolves it"
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    try:
        if choice is None or choice == "auto":
            syntax, grammar = auto_call_grammar(tools, request.tool_format, request.parallel_tool_calls,
                                                special_marker_ids(tokenizer))
        else:
            forced: ToolChoice = choice.model_dump() if isinstance(choice, NamedToolChoice) else "required"
            syntax, grammar = forced_call_grammar(tools, forced, request.tool_format, request.parallel_tool_calls)
    except ValueError as error:
        raise ProtocolError([str(error)]) from None
    return _compiled(Constraint(syntax, grammar), "tools")


@lru_cache(maxsize=4)
def special_marker_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The tool-call markers that are special tokens of this tokenizer, by id: a grammar's free
    text cannot hold a special token, so the auto grammar allows these by id."""
    ids = {marker: tokenizer.token_to_id(marker) for marker in SPECIAL_MARKERS}
    return {marker: i for marker, i in ids.items() if i is not None and i in tokenizer.special_token_ids}


def sampler_settings(sampling: SamplingParams, tokenizer: Tokenizer, vocab_size: int) -> SamplerSettings:
    """The engine's settings from the wire's: every SamplerSettings field the wire has by the same name
    is copied (the engine normalises lists and dicts), the ones in DERIVED are computed."""
    values = {name: getattr(sampling, name) for name in SAME_NAMED}
    values.update({name: derive(sampling, tokenizer, vocab_size) for name, derive in DERIVED.items()})
    return SamplerSettings(**values)


def dry_sequence_breakers(sampling: SamplingParams, tokenizer: Tokenizer, vocab_size: int) -> tuple[int, ...]:
    """The engine takes DRY's sequence breakers as token ids; the wire, as strings: every token
    whose text holds one of them breaks a sequence (null: exllamav2's default strings, and the
    special tokens, as exllamav2 derives its default set)."""
    if sampling.dry_multiplier == 0.0:
        return ()
    given = sampling.dry_sequence_breakers
    ids = tokenizer.ids_containing(DRY_DEFAULT_SEQUENCE_BREAKERS if given is None else given, special=given is None)
    return tuple(t for t in ids if t < vocab_size)


def xtc_spared_tokens(sampling: SamplingParams, tokenizer: Tokenizer, vocab_size: int) -> tuple[int, ...]:
    """The tokens XTC never excludes, exllamav2's default: newlines and special tokens (EOS among
    them, so XTC does not stop a text from ending)."""
    if sampling.xtc_probability == 0.0:
        return ()
    return tuple(t for t in tokenizer.ids_containing(XTC_SPARED, special=True) if t < vocab_size)


def engine_constraint(wire: OutputConstraint) -> Constraint:
    """The engine's Constraint for the request's (from the protocol's one conversion, grammar_source),
    compiled here on the task thread (and cached), so a grammar that does not compile fails the
    request naming it and never reaches the engine loop."""
    return _compiled(Constraint(*grammar_source(wire)), "constraint")


def _compiled(constraint: Constraint, field: str) -> Constraint:
    """constraint, compiled (and cached) here, or a ProtocolError naming the request's field."""
    try:
        compiled_grammar(constraint)
    except ValueError as error:
        raise ProtocolError([f"{field}: {error}"]) from None
    return constraint


DERIVED: dict[str, Callable[[SamplingParams, Tokenizer, int], tuple[int, ...]]] = {
    "dry_sequence_breakers": dry_sequence_breakers,  # strings on the wire, token ids in the engine
    "xtc_ignore_tokens": xtc_spared_tokens,  # not on the wire: exllamav2's default set
}
"""Engine sampling fields whose wire name or value differs."""
SAME_NAMED = tuple(f.name for f in fields(SamplerSettings)
                   if f.name in SamplingParams.model_fields and f.name not in DERIVED)
"""Engine sampling fields the wire sends under the same name and meaning."""
JOB_DERIVED = frozenset({"input_ids", "identifier", "constraint", "priority"})
"""Job arguments the wire has under the same name that build_job computes (tokens, the delivery's
identifier, the compiled constraint, the priority's default)."""
JOB_SAME_NAMED = tuple(name for name in inspect.signature(Job).parameters
                       if name in GenerationRequest.model_fields and name not in JOB_DERIVED)
"""Job arguments the wire sends under the same name and meaning (max_new_tokens, logprobs, adapter, ...)."""
