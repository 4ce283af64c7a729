"""Who drives a batch: every gateway process runs a BatchDriver, which steps each active batch
whose lease it holds (records.lease; a gateway that stops stepping loses it after
GENQ_GATEWAY_BATCH_LEASE_S and another takes over). A step is idempotent, so a crash at any
point, or two gateways stepping one batch after a lease lapsed, loses and repeats no line:

1. collect: each queued line that has not ended is looked up in the result backend; an ended
   one's answer is written to its part file, then counted once (records.mark_done's HSETNX);
2. queue: the next lines, up to GENQ_GATEWAY_BATCH_MAX_IN_FLIGHT outstanding, are sent as
   `genq.generate` tasks whose id is `<batch id>-<line index>`, then `sent` is advanced. A crash
   between the two re-sends the same ids, which the workers answer from the stored result or
   leave to the worker already running it (worker/delivery.py) instead of generating again;
3. finish: once every line has ended (or, cancelling or past the window, every queued line),
   the output and error files are written from the parts under ids derived from the batch id,
   the webhook is sent, and the status is set.

A queued line the broker lost (a worker or Redis killed between kombu's pop and its
unacknowledged record) is sent again by the runner's watchdog; a driver that takes a batch over
watches the lines it finds queued. The genq specifics (translating a line, reading a task's
outcome, the watchdog, the webhook) are the LineRunner's: the gateway's
(producer/gateway/batch_runner.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import anyio

from producer.batches.input_file import BatchLine, InputLimits, InputRefused, parse_lines
from producer.batches.owners import ADMIN, Owner
from producer.batches.records import TERMINAL, Batch, BatchError, BatchRecords, BatchStatus, LineOutcome
from producer.batches.storage import FileStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LineAnswer:
    """How a line ended: an HTTP-like response (`status_code`, `body`), or, for a line that got
    none (cancelled, expired), an `error` object; output lines go to the output file, the rest
    to the error file."""

    kind: Literal["output", "error"]
    status_code: int | None = None
    body: dict[str, Any] | None = None
    error: dict[str, str] | None = None


class LineRunner(Protocol):
    async def send(self, batch: Batch, owner: Owner, lines: list[tuple[BatchLine, str]]
                   ) -> list[tuple[BatchLine, LineAnswer]]:
        """Queue each line's task under its identifier, run as `owner`'s; the lines that could not
        be queued, answered."""

    async def answer(self, batch: Batch, line: BatchLine, identifier: str) -> LineAnswer | None:
        """The line's answer once its task has ended, else None."""

    async def watch(self, batch: Batch, owner: Owner, lines: list[tuple[BatchLine, str]]) -> None:
        """Watch lines another process queued (a batch taken over), as if this one had sent them."""

    async def cancel(self, identifier: str) -> None: ...

    async def notify(self, batch: Batch) -> None:
        """Tell whoever the batch's metadata names that it ended."""


def line_identifier(batch_id: str, index: int) -> str:
    """The task id of line `index`: the same on every try, so that a line is never run twice."""
    return f"{batch_id}-{index}"


class BatchDriver:
    def __init__(self, records: BatchRecords, store: FileStore, runner: LineRunner, limits: InputLimits, *,
                 max_in_flight: int, poll_s: float, lease_s: float) -> None:
        self.records, self.store, self.runner, self.limits = records, store, runner, limits
        self.max_in_flight, self.poll_s, self.lease_s = max_in_flight, poll_s, lease_s
        self.owner = uuid.uuid4().hex
        self._lines: dict[str, list[BatchLine]] = {}

    async def run(self) -> None:
        """Step the batches every poll interval until cancelled. A failed tick (Redis away, a
        full disk) is logged and tried again: the next tick picks up where the records say."""
        while True:
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - the loop outlives any one tick's failure
                log.exception("batch driver tick failed; retrying in %.1f s", self.poll_s)
            await asyncio.sleep(self.poll_s)

    async def tick(self) -> None:
        for batch_id in await self.records.active():
            if await self.records.lease(batch_id, self.owner, self.lease_s):
                await self.step(batch_id)
        await self.store.sweep()

    async def step(self, batch_id: str) -> None:
        found = await self.records.owned(batch_id)
        if found is None or found[0].status in TERMINAL:
            self._lines.pop(batch_id, None)
            await self.records.retire(batch_id)
            return
        batch, owner = found
        taken_over = batch_id not in self._lines
        lines = await self._input(batch)
        if lines is None:
            return
        if batch.status == "validating":
            await self.records.transition(batch_id, "in_progress", "validating")
        sent, done = await self.records.progress(batch_id)
        if taken_over:
            await self.runner.watch(batch, owner, [(lines[index], line_identifier(batch_id, index))
                                            for index in range(sent) if index not in done])
        for index in range(sent):
            if index not in done:
                identifier = line_identifier(batch_id, index)
                answer = await self.runner.answer(batch, lines[index], identifier)
                if answer is not None:
                    await self._record(batch_id, lines[index], answer, done)
        if batch.status == "cancelling" or (batch.status != "finalizing" and time.time() >= batch.expires_at):
            outstanding = [index for index in range(sent) if index not in done]
            for index in outstanding:
                await self.runner.cancel(line_identifier(batch_id, index))
            if not outstanding:
                await self._finish(batch, owner, lines, sent,
                                   "cancelled" if batch.status == "cancelling" else "expired")
            return
        page = lines[sent:sent + max(0, self.max_in_flight - (sent - len(done)))]
        if page:
            refused = await self.runner.send(batch, owner,
                                             [(line, line_identifier(batch_id, line.index)) for line in page])
            for line, answer in refused:
                await self._record(batch_id, line, answer, done)
            await self.records.set_sent(batch_id, sent + len(page))
        elif len(done) == len(lines):
            await self._finish(batch, owner, lines, sent, "completed")

    async def _input(self, batch: Batch) -> list[BatchLine] | None:
        """The batch's lines (parsed once per driver); None, having failed the batch, when its
        input file is gone or no longer valid."""
        if (lines := self._lines.get(batch.id)) is not None:
            return lines
        data = await self.store.read(batch.input_file_id, ADMIN)  # its owner's, checked when the batch was made
        problem = f"input file {batch.input_file_id} no longer exists"
        if data is not None:
            try:
                lines = await anyio.to_thread.run_sync(parse_lines, data, self.limits)
            except InputRefused as refused:
                problem = str(refused)
        if lines is None:
            await self.records.fail(batch.id, [BatchError(code="invalid_input_file", message=problem,
                                                          param="input_file_id")])
            await self.records.retire(batch.id)
            return None
        self._lines[batch.id] = lines
        return lines

    async def _record(self, batch_id: str, line: BatchLine, answer: LineAnswer, done: dict[int, LineOutcome]
                      ) -> None:
        """Write the line's answer in OpenAI's line format, then count it (once)."""
        identifier = line_identifier(batch_id, line.index)
        response = None if answer.status_code is None else {
            "status_code": answer.status_code, "request_id": identifier, "body": answer.body}
        await self.store.write_part(batch_id, line.index, answer.kind, {
            "id": f"batch_req_{identifier}", "custom_id": line.custom_id, "response": response,
            "error": answer.error})
        outcome: LineOutcome = "completed" if answer.kind == "output" else "failed"
        await self.records.mark_done(batch_id, line.index, outcome)
        done[line.index] = outcome

    async def _finish(self, batch: Batch, owner: Owner, lines: list[BatchLine], sent: int, status: BatchStatus
                      ) -> None:
        if status == "completed" and batch.status != "finalizing" and not await self.records.transition(
                batch.id, "finalizing", "in_progress"):
            return  # cancelled meanwhile: the next step finishes it as cancelled
        if status == "expired":
            expired = LineAnswer("error", error={"code": "batch_expired", "message": "the batch's completion "
                                                 "window ended before this request was run"})
            for line in lines[sent:]:
                await self._record(batch.id, line, expired, {})
        parts = await self.store.read_parts(batch.id, len(lines))
        output_id = await self._write(batch, owner, "output", [line for kind, line in parts if kind == "output"])
        error_id = await self._write(batch, owner, "error", [line for kind, line in parts if kind == "error"])
        ended = await self.records.get(batch.id, ADMIN)
        if ended is None:
            return
        now = int(time.time())
        await self.runner.notify(ended.model_copy(update={"status": status, f"{status}_at": now,
                                                          "output_file_id": output_id, "error_file_id": error_id}))
        allowed: dict[str, tuple[BatchStatus, ...]] = {"completed": ("finalizing",), "cancelled": ("cancelling",),
                                                       "expired": ("in_progress",)}
        if await self.records.finish(batch.id, status, output_id, error_id, *allowed[status]):
            await self.store.drop_parts(batch.id)
            self._lines.pop(batch.id, None)

    async def _write(self, batch: Batch, owner: Owner, kind: str, lines: list[dict[str, Any]]) -> str | None:
        """The batch's output or error file (none for no lines), under an id derived from the batch's,
        owned by the batch's owner."""
        if not lines:
            return None
        content = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
        file_id = f"file-{batch.id.removeprefix('batch_')}-{kind}"
        await self.store.create(content, f"{batch.id}_{kind}.jsonl", "batch_output", owner, file_id)
        return file_id
