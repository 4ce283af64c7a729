"""POST /v1/completions: OpenAI's text completions, of one prompt or of a list of them.

Each prompt is its own genq task: with one prompt the task's identifier is the response's id
(`cmpl-<hex>`), with a list prompt i's is `<id>-<i>`. Every prompt is checked (the protocol's
rules, then the model card's limits) before any task is queued, so one bad prompt is a 400 naming
`prompt[i]` and nothing runs. The request counts once against admission (the queue depth) and,
streamed, takes one of its client's stream slots, however many prompts it has. The tasks are sent
together (producer/client.py submit_many); choice prompt * n + sample answers sample `sample` of
prompt `prompt` (OpenAI's order), and the usage is the tasks' summed. Streamed, the tasks' events
are read side by side (sse.merged), so chunks of different prompts interleave, each with its
choice's index; the usage chunk and `[DONE]` follow once every task has ended.

echo: each choice's text begins with its prompt: a string as sent, token ids decoded with the
workers' tokenizer from the model card (special tokens kept), the first chunk of each streamed
choice. echo with logprobs puts the prompt's tokens first in the legacy logprobs object, the
first with null logprob, from the worker's prompt log-probabilities (the request's
prompt_logprobs); vLLM's prompt_logprobs parameter answers in each choice's `prompt_logprobs`.
Streamed, both ride on each choice's first chunk, sent once the task's chunk event brings them.

A client that disconnects cancels every task of its request; a task that fails fails the request
(400 generation_failed, or the stream's error chunk) and cancels the others.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Iterator, Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from producer.client import AsyncGenerationHandle, GenerationError, TextAssembler
from producer.gateway import sse
from producer.gateway.errors import CLIENT_CLOSED_REQUEST, ApiError
from producer.gateway.model_limits import ModelLimits, PromptTokenizer, check_request
from producer.gateway.openai_api import (
    STREAM_FAILURES,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionUsage,
    Echo,
    MissingPromptLogprobs,
    OpenAIFinishReason,
    ScoredPrompt,
    UnsupportedParameter,
    completion_response,
    openai_finish_reason,
    stream_error,
    total_usage,
)
from producer.gateway.prompt_gate import PromptGate
from producer.gateway.sse_coalescing import coalesced
from producer.gateway.submission import parse_request, resuming, routed
from producer.protocol import GenerationRequest, GenerationResult, StreamEvent, TokenLogprob, Usage

if TYPE_CHECKING:
    from producer.gateway.app import Gateway
    from producer.gateway.model_router import Target


def completions_router(gateway_token: Any, error_responses: Mapping[int | str, dict[str, Any]]) -> APIRouter:
    """The endpoint, behind the gateway's token dependency."""
    router = APIRouter()

    @router.post("/v1/completions", response_model=Completion, dependencies=[Depends(gateway_token)],
                 responses={**error_responses, 200: {"content": {"text/event-stream": {}}}})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """OpenAI's text completions, streamed (`stream: true`) or not; `prompt` may be a list."""
        return await _complete(request.app.state.gateway, request, body)

    return router


async def completion_generations(gateway: Gateway, body: CompletionRequest, identifier: str
                                 ) -> tuple[list[tuple[GenerationRequest, int]], Echo, Target]:
    """A completions request as the genq requests it runs as (one per prompt: `identifier`, or
    `<identifier>-<i>` for a list), each checked against the model's card, with its prompt's token
    count; what the answer shows of
    the prompts; and where they go: the one translation of `/v1/completions` (the batch lines' too)."""
    target = await gateway.router.resolve(body.model)
    try:
        fields = body.to_request_fields(gateway.settings.ignore_unknown_params)
        prompts = body.prompts()
    except UnsupportedParameter as error:
        raise ApiError(400, error.code, str(error), param=error.param) from None
    fields = routed(fields, target)
    limits = await target.cards.current()
    checked = [await _checked(gateway, limits, body, {**fields, _prompt_field(prompt): prompt},
                              identifier if len(prompts) == 1 else f"{identifier}-{i}", i)
               for i, prompt in enumerate(prompts)]
    return checked, await _echo(limits, body, prompts), target


async def _complete(gateway: Gateway, request: Request, body: CompletionRequest) -> Any:
    identifier = f"cmpl-{uuid.uuid4().hex}"
    checked, echo, target = await completion_generations(gateway, body, identifier)
    await gateway.admit(target.route.queue)
    generations = await gateway.tenancy.admit(request, [g for g, _ in checked], [tokens for _, tokens in checked])
    if body.stream:
        give_back = gateway.streams.take(identifier, sse.client_identity(request))
        try:
            handles = await _submit(gateway, request, generations, target.route.queue)
        except BaseException:
            give_back()
            raise
        chunks = _stream(gateway, handles, identifier, body, echo)
        return sse.EventStream(chunks, give_back)
    handles = await _submit(gateway, request, generations, target.route.queue)
    results = await _results(gateway, request, handles)
    if results is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        return completion_response(identifier, body.model, results, echo)
    except MissingPromptLogprobs as missing:
        raise ApiError(502, "missing_prompt_logprobs", str(missing)) from None


def _prompt_field(prompt: str | list[int]) -> str:
    return "prompt" if isinstance(prompt, str) else "input_ids"


async def _checked(gateway: Gateway, limits: ModelLimits | None, body: CompletionRequest, fields: dict[str, Any],
                   identifier: str, index: int) -> tuple[GenerationRequest, int]:
    """Prompt `index`'s request, checked as a single prompt's is, and its prompt tokens (0 without
    a card); a refusal names prompt[index] when the prompt is a list."""
    names = body.param_names()
    if body.batched:
        names = {**names, "prompt": f"prompt[{index}]", "input_ids": f"prompt[{index}]"}
    generation = await parse_request(gateway.constraints, {**fields, "identifier": identifier}, status=400, names=names)
    return generation, 0 if limits is None else await check_request(limits, generation, status=400, names=names)


async def _echo(limits: ModelLimits | None, body: CompletionRequest, prompts: list[str | list[int]]) -> Echo:
    """What the answer shows of the prompts: a token-id prompt's text and the names of the tokens
    the worker gives no logprob need the workers' tokenizer (the model card's); without one the
    request is refused (400, as the gateway answers every request it cannot take, never a 5xx)."""
    needs_tokenizer = body.echo_logprobs or (bool(body.echo) and not all(isinstance(p, str) for p in prompts))
    tokenizer = None if limits is None else limits.tokenizer
    if needs_tokenizer and tokenizer is None:
        why = "echo of token ids" if not body.echo_logprobs else "echo with logprobs"
        raise ApiError(400, "tokenizer_unavailable", f"echo: {why} needs the model's tokenizer, and no single one is "
                                                     "published (no worker's model card yet, or workers that "
                                                     "disagree); retry once a worker is up", param="echo")
    texts = None
    if body.echo:
        assert tokenizer is not None or all(isinstance(p, str) for p in prompts)
        texts = [p if isinstance(p, str) else await anyio.to_thread.run_sync(_decode, tokenizer, p) for p in prompts]
    return Echo(texts=texts, alternatives=body.logprobs if body.echo_logprobs else None,
                token_text=None if tokenizer is None else (lambda token: _decode(tokenizer, [token])),
                prompt_logprobs=body.prompt_logprobs)


def _decode(tokenizer: PromptTokenizer | None, tokens: list[int]) -> str:
    """Tokens as text, special tokens included (they are part of the prompt), as the worker names
    a logprob's token."""
    assert tokenizer is not None
    return tokenizer.backend.decode(tokens, skip_special_tokens=False)


async def _submit(gateway: Gateway, request: Request, generations: list[GenerationRequest], queue: str
                  ) -> list[AsyncGenerationHandle]:
    """Every prompt's task to the model's queue, over one broker connection; should sending fail
    part way, the tasks already sent are cancelled, and what an API key's admission reserved for
    them is given back."""
    try:
        return await gateway.client.submit_many(generations, queue=queue)
    except BaseException:
        with anyio.CancelScope(shield=True):
            identifiers = [generation.identifier for generation in generations if generation.identifier is not None]
            for identifier in identifiers:
                await gateway.client.cancel(identifier)
            await gateway.tenancy.release(request, identifiers)
        raise


async def _results(gateway: Gateway, request: Request, handles: list[AsyncGenerationHandle]
                   ) -> list[GenerationResult] | None:
    """Every task's result, or None when the client went away first; whatever ends the wait
    early cancels the tasks."""
    timeout = gateway.settings.result_timeout_s
    finished = False
    try:
        results = await sse.unless_disconnected(request, _gather(handles, timeout))
        finished = results is not None
        return results
    except GenerationError as error:
        # Nearly always the request's fault (a token outside the vocabulary, a prompt longer than the
        # context): 400, so that SDKs do not retry it; the message is the worker's.
        raise ApiError(400, "generation_failed", error.message) from None
    except TimeoutError:
        raise ApiError(504, "timeout", f"no result within {timeout:.0f} s; cancelled") from None
    finally:
        if not finished:
            with anyio.CancelScope(shield=True):
                for handle in handles:
                    await gateway.client.cancel(handle.id)


async def _gather(handles: list[AsyncGenerationHandle], timeout: float) -> list[GenerationResult]:
    """The results, in the handles' order; the first failure (raised as it is) gives up the other waits."""
    waits = [asyncio.ensure_future(handle.result(timeout=timeout)) for handle in handles]
    try:
        return list(await asyncio.gather(*waits))
    finally:
        for wait in waits:
            wait.cancel()


async def _stream(gateway: Gateway, handles: list[AsyncGenerationHandle], identifier: str, body: CompletionRequest,
                  echo: Echo) -> AsyncGenerator[str, None]:
    """OpenAI's streaming format over every prompt's task: each choice's echo first, when asked,
    then each piece of text as it comes (the logprobs with it), a finish chunk per choice when its
    task ends, a usage chunk when asked, then `data: [DONE]`. When the answer shows the prompt's
    log-probabilities (echo with logprobs, prompt_logprobs) each choice's first chunk carries them
    (the echo, if any, with its tokens' logprobs; vLLM's prompt_logprobs): it waits for the chunk
    event that brings them, and a PromptGate holds the task's text back until then. A task's error
    ends the stream with an error chunk. If a worker dies mid-generation, the redelivered attempt
    continues each sample's text where it stopped (a TextAssembler per choice). Closing the stream
    before the end (the client left) cancels the tasks that have not ended."""
    n, created = body.n_choices, int(time.time())
    offsets = [0] * (len(handles) * n)  # each choice's tokens' text so far: the legacy logprobs' text_offset
    assemblers = [[TextAssembler(handle.id, sample) for sample in range(n)] for handle in handles]
    gates = [PromptGate(waiting=echo.scores_prompts) for _ in handles]
    ended = [False] * len(handles)
    usages: list[Usage] = []

    def chunk(index: int, text: str, finish_reason: OpenAIFinishReason | None = None,
              logprobs: list[TokenLogprob] | None = None) -> str:
        answer = Completion(id=identifier, created=created, model=body.model, choices=[
            CompletionChoice(index=index, text=text, finish_reason=finish_reason,
                             logprobs=CompletionLogprobs.from_tokens(logprobs, offsets[index]))])
        offsets[index] += sum(len(lp.token) for lp in logprobs or ())
        return sse.message(answer.model_dump_json())

    def pieces(prompt: int, event: StreamEvent) -> Iterator[str]:
        """The chunks of one of the task's events: a piece of text (the logprobs with it), or,
        when it ends, each choice's rest and finish chunk (an error event raises GenerationError
        from feed())."""
        if event.event == "chunk":
            sample = event.index or 0
            text = assemblers[prompt][sample].feed(event)
            if text or event.logprobs:
                yield chunk(prompt * n + sample, text, logprobs=event.logprobs)
        elif event.is_terminal:
            reasons = {choice.index: choice.finish_reason for choice in event.choices or ()}
            for sample, assembler in enumerate(assemblers[prompt]):
                rest = assembler.feed(event)
                if rest:
                    yield chunk(prompt * n + sample, rest)
                reason = openai_finish_reason(reasons.get(sample, event.finish_reason or "stop"))
                yield chunk(prompt * n + sample, "", reason)
            if event.usage is not None:
                usages.append(event.usage)

    def opening(prompt: int, scored: ScoredPrompt | None) -> Iterator[str]:
        """Each of the prompt's choices' first chunk: what it shows of its prompt (Echo.opening)."""
        for index in range(prompt * n, prompt * n + n):
            choice = echo.opening(prompt, index, scored)
            offsets[index] = sum(map(len, choice.logprobs.tokens)) if choice.logprobs is not None else 0
            answer = Completion(id=identifier, created=created, model=body.model, choices=[choice])
            yield sse.message(answer.model_dump_json())

    try:
        if not echo.scores_prompts and echo.texts is not None:
            for prompt in range(len(handles)):
                for piece in opening(prompt, None):
                    yield piece
        timeout = gateway.settings.stream_idle_timeout_s
        interval_s = body.coalesce_s(gateway.settings.stream_coalesce_ms)
        events = sse.merged([coalesced(resuming(handle, timeout), interval_s) for handle in handles])
        async with aclosing(sse.with_keepalive(events, gateway.settings.keepalive_s)) as items:
            async for item in items:
                if item is None:
                    yield sse.KEEPALIVE
                    continue
                prompt, event = item
                ended[prompt] = event.is_terminal
                scored, ready = gates[prompt].feed(event)
                if scored is not None:
                    for piece in opening(prompt, scored):
                        yield piece
                for passed in ready:
                    for piece in pieces(prompt, passed):
                        yield piece
        if body.include_usage:
            totals = CompletionUsage.from_usage(total_usage(usages))
            answer = Completion(id=identifier, created=created, model=body.model, choices=[], usage=totals)
            yield sse.message(answer.model_dump_json())
        yield "data: [DONE]\n\n"
    except STREAM_FAILURES as failure:
        yield stream_error(failure)
    finally:
        # The client left (the server cancels this generator), or a task failed or its stream
        # broke: stop the GPU work of the others.
        with anyio.CancelScope(shield=True):
            for handle, done in zip(handles, ended):
                if not done:
                    await gateway.client.cancel(handle.id)

