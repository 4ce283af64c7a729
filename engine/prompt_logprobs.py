"""Prompt log-probabilities (Job(prompt_logprobs=k), vLLM's prompt_logprobs), scored in the prefill.

A job that asks has the logits of every position of its prompt chunks computed (BatchRow asks for
them; the prefix cache is skipped while Sequence.scores_prompt): position i's logits score prompt
token i + 1. The distribution is the model's own, log_softmax of the raw logits, as vLLM reports
prompt logprobs: no bias, ban, penalty, constraint or temperature, which belong to sampling a
token. The last prompt position's logits are also the ones the first token is drawn from: one
row serves both, nothing runs twice. Each chunk is reduced on the device to its targets'
log-probabilities and the k best alternatives before anything is read back, so a step keeps
[chunk, k] numbers, never [chunk, vocab] beyond the forward's own logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PromptChunk:
    """Rows [first_row, first_row + len(targets)) of a step's logits score the job's prompt
    tokens targets, which sit at positions first_target, first_target + 1, ..."""

    sequence: Sequence
    first_row: int
    first_target: int
    targets: list[int]

    @classmethod
    def of(cls, sequence: Sequence, start: int, num_positions: int, first_row: int) -> PromptChunk | None:
        """The chunk of a row computing positions [start, start + num_positions) whose logits
        begin at first_row; None when they score no prompt token (the prompt's last position).
        The targets come from the job's prompt, so a token token healing took off is scored too,
        by the last position the model reads."""
        prompt = sequence.job.input_ids
        end = min(start + num_positions, len(prompt) - 1)
        if end <= start:
            return None
        return cls(sequence, first_row, start + 1, prompt[start + 1 : end + 1])


@dataclass(frozen=True)
class ScoredPrompts:
    """A step's prompt chunks reduced on the device: each target's log-probability, and the
    best max(k) alternatives of its position (best first), chunk after chunk."""

    chunks: list[PromptChunk]
    chosen: torch.Tensor  # [N]
    top_values: torch.Tensor | None  # [N, max k]
    top_ids: torch.Tensor | None

    @classmethod
    def compute(cls, logits: torch.Tensor, chunks: list[PromptChunk]) -> ScoredPrompts:
        """From the step's fp32 logits; log_softmax is taken as x - logsumexp(x) at the rows'
        targets and top-k only, so no second [rows, vocab] tensor is made."""
        k = max(chunk.sequence.job.prompt_logprobs or 0 for chunk in chunks)
        chosen: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        ids: list[torch.Tensor] = []
        for chunk in chunks:
            x = logits[chunk.first_row : chunk.first_row + len(chunk.targets)]
            norm = torch.logsumexp(x, dim=-1)
            targets = torch.tensor(chunk.targets, dtype=torch.long).to(x.device, non_blocking=True)
            chosen.append(x.gather(1, targets[:, None]).squeeze(1) - norm)
            if k:
                top = x.topk(k, dim=-1)
                values.append(top.values - norm[:, None])
                ids.append(top.indices)
        return cls(chunks, torch.cat(chosen), torch.cat(values) if k else None, torch.cat(ids) if k else None)

    def to_host(self) -> dict[int, tuple[int, list[TokenLogprob]]]:
        """serial -> (the position of its first scored token, a TokenLogprob per token, each with
        the job's own number of alternatives). One read-back."""
        chosen = self.chosen.tolist()
        values = self.top_values.tolist() if self.top_values is not None else [[]] * len(chosen)
        ids = self.top_ids.tolist() if self.top_ids is not None else [[]] * len(chosen)
        scored: dict[int, tuple[int, list[TokenLogprob]]] = {}
        row = 0
        for chunk in self.chunks:
            k = chunk.sequence.job.prompt_logprobs or 0
            entries = []
            for target in chunk.targets:
                entries.append(TokenLogprob(target, chosen[row], tuple(zip(ids[row][:k], values[row][:k],
                                                                             strict=True))))
                row += 1
            scored[chunk.sequence.serial] = (chunk.first_target, entries)
        return scored
