"""Streamed answers that show the prompt's log-probabilities first (completions' echo with
logprobs, vLLM's prompt_logprobs): a task's events wait behind a PromptGate until the chunk that
carries them arrives, so that the chunk showing them goes out before any of the task's text."""

from __future__ import annotations

from dataclasses import dataclass, field

from producer.gateway.openai_api import MissingPromptLogprobs, ScoredPrompt
from producer.protocol import StreamEvent


@dataclass
class PromptGate:
    """One task's events, held until its prompt's log-probabilities come: the worker sends them
    on sample 0's first chunk after the prefill (docs/protocol.md section 3), and the other
    samples' chunks may come before it. `waiting` False (nothing to wait for) passes every event.
    A redelivered attempt sends them again: once the gate is open its copy passes as any chunk
    (what was shown stands: the same prompt, scored again), while a gate still closed opens on
    whichever attempt's comes first, the newest."""

    waiting: bool
    held: list[StreamEvent] = field(default_factory=list)

    def feed(self, event: StreamEvent) -> tuple[ScoredPrompt | None, list[StreamEvent]]:
        """The scored prompt when this event opens the gate, and the events to handle now, in
        order. An error event passes (its reader raises the failure); a task that ends without
        sending them raises MissingPromptLogprobs."""
        if not self.waiting:
            return None, [event]
        if event.prompt_logprobs is not None:
            self.waiting = False
            held, self.held = self.held, []
            return ScoredPrompt.of(event), [*held, event]
        if event.event == "error":
            return None, [event]
        if event.is_terminal:
            raise MissingPromptLogprobs(event.id)
        self.held.append(event)
        return None, []
