"""Turn a validated wire request into an engine Job (on the task thread, so
tokenization runs in parallel with the engine loop)."""

from __future__ import annotations

from engine import Constraint, Job, SamplerSettings, Tokenizer
from engine.constraints import compiled_grammar
from producer.protocol import (
    DRY_DEFAULT_SEQUENCE_BREAKERS,
    XTC_SPARED,
    ChoiceConstraint,
    GenerationRequest,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    OutputConstraint,
    ProtocolError,
    RegexConstraint,
    SamplingParams,
)

# Sampling settings with the same name and meaning on the wire and in the engine.
SAME_NAMED = (
    "repetition_penalty_range", "repetition_penalty_decay", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_range", "smoothing_factor", "tfs", "typical", "mirostat", "mirostat_tau", "mirostat_eta",
    "temperature_last", "min_temp", "max_temp", "temp_exponent", "xtc_probability", "xtc_threshold", "skew",
)


def build_job(
    request: GenerationRequest, tokenizer: Tokenizer, identifier: str, vocab_size: int, max_seq_len: int
) -> Job:
    """The engine job for `request`. `vocab_size` is the model's: the protocol bounds token ids
    only by int32, so stop tokens the model can never produce are refused here (the engine
    refuses such input_ids, sampling settings refuse such banned ids and biases)."""
    for index, token in enumerate(request.stop_token_ids):
        if token >= vocab_size:
            raise ProtocolError([f"stop_token_ids[{index}]: token id {token} is outside the vocabulary "
                                 f"[0, {vocab_size})"])
    if request.prompt is not None:
        field = "prompt"
        add_bos = tokenizer.add_bos_token if request.add_bos is None else request.add_bos
        input_ids = tokenizer.encode(request.prompt, add_special_tokens=add_bos)
        if not input_ids:
            raise ProtocolError(["prompt: encodes to no tokens"])
    elif request.messages is not None:
        field = "messages"
        if tokenizer.chat_template is None:
            raise ProtocolError(["messages: this model has no chat template; send prompt or input_ids"])
        input_ids = tokenizer.encode_chat([m.model_dump() for m in request.messages])
    else:
        field = "input_ids"
        input_ids = list(request.input_ids or ())
    total = len(input_ids) + request.max_new_tokens
    if total > max_seq_len:
        # Checked here, not only in the engine, so that the message names the field the producer sent.
        problem = (f"{field}: {len(input_ids)} tokens + max_new_tokens ({request.max_new_tokens}) = {total} "
                   f"exceeds the model's max_seq_len={max_seq_len}")
        raise ProtocolError([problem])
    stops: list[int | str] = [*request.stop, *request.stop_token_ids]
    if not request.ignore_eos:
        stops += tokenizer.eos_token_ids
    sampling = request.sampling
    settings = SamplerSettings(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        top_a=sampling.top_a,
        repetition_penalty=sampling.repetition_penalty,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        token_bias=dict(sampling.token_bias),
        banned_token_ids=tuple(sampling.banned_token_ids),
        allowed_token_ids=tuple(sampling.allowed_token_ids),
        dry_sequence_breakers=dry_sequence_breakers(sampling, tokenizer, vocab_size),
        xtc_ignore_tokens=xtc_spared_tokens(sampling, tokenizer, vocab_size),
        **{name: getattr(sampling, name) for name in SAME_NAMED},
    )
    return Job(
        input_ids,
        request.max_new_tokens,
        min_new_tokens=request.min_new_tokens,
        stop_conditions=stops,
        gen_settings=settings,
        identifier=identifier,
        seed=sampling.seed,
        decode_special_tokens=request.decode_special_tokens,
        constraint=engine_constraint(request.constraint) if request.constraint is not None else None,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        # The queue's priority orders admission in the engine too (0 = most urgent; none = 0, as on the broker).
        priority=request.priority or 0,
        max_skips=request.max_skips,
        banned_strings=request.banned_strings,
        token_healing=request.token_healing,
    )


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
    """The engine's Constraint for the request's, compiled here on the task thread (and cached), so
    a grammar that does not compile fails the request naming it and never reaches the engine loop."""
    if isinstance(wire, JsonSchemaConstraint):
        constraint = Constraint.json_schema(wire.json_schema)
    elif isinstance(wire, JsonObjectConstraint):
        constraint = Constraint.json_object()
    elif isinstance(wire, RegexConstraint):
        constraint = Constraint.regex(wire.pattern)
    elif isinstance(wire, ChoiceConstraint):
        constraint = Constraint.choice(wire.choices)
    else:
        assert isinstance(wire, GrammarConstraint)
        constraint = Constraint.grammar(wire.grammar, wire.syntax)
    try:
        compiled_grammar(constraint)
    except ValueError as error:
        raise ProtocolError([f"constraint: {error}"]) from None
    return constraint
