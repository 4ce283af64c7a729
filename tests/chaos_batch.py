"""The chaos run's batch (issue 29): an OpenAI batch of completions, uploaded with the `openai` SDK
to a real `genq gateway` at the start of the run and driven through the same worker SIGKILLs and
Redis faults as the tasks, while the gateway itself is SIGKILLed and started again (its successor
takes the batch over once the dead one's lease lapses). At the end the batch must have completed,
its output file holding every custom_id exactly once, each answer under its own line's task id
with the text the engine gives the line's prompt greedily in the test's own process. Whether each
line's task ended once (one final event) is checked with the tasks' (tests/chaos.py).

Batch lines run at the batch priority, below the tasks, and at most GENQ_GATEWAY_BATCH_MAX_IN_FLIGHT
at once, so at a pace of their own; the faults meant for the batch are therefore scheduled by
lines answered, not by tasks.
"""

from __future__ import annotations

import json
import logging
import signal
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import redis
from celery import states

from tests.gateway_service import MODEL, TOKEN, GatewayProcess, service_env
from tests.test_batches import ENDED

log = logging.getLogger(__name__)


@dataclass
class BatchFigures:
    lines: int = 0
    status: str = ""
    completed: int = 0
    failed: int = 0
    lost: list[str] = field(default_factory=list)
    """custom_ids in neither the output nor the error file."""
    repeated: list[str] = field(default_factory=list)
    """custom_ids in the files more than once, or whose task ended more than once."""
    wrong_answers: list[str] = field(default_factory=list)
    """custom_ids answered with an error, under another line's task id, or with other text."""
    redelivered: int = 0
    """Lines whose task was delivered again (a worker killed mid-line, a resend): run again only if
    the first delivery never ended."""
    gateway_kills_mid_batch: int = 0
    """Gateway SIGKILLs while the batch had not yet ended."""


class ChaosBatch:
    """The gateway in front of the chaos queue and the batch it drives. `tokens` is each line's
    max_tokens (greedy, ignore_eos: every line generates exactly that many)."""

    def __init__(self, redis_url: str, queue: str, workdir: Path, lines: int, tokens: int, lease_s: float,
                 resend_after_s: float) -> None:
        self.redis_url = redis_url
        self.workdir = workdir
        self.lines = lines
        self.tokens = tokens
        self.env = {**service_env(redis_url), "GENQ_QUEUE": queue, "GENQ_GATEWAY_TOKEN": TOKEN,
                    "GENQ_GATEWAY_MODEL_NAME": MODEL, "GENQ_GATEWAY_FILES_DIR": str(workdir / "files"),
                    "GENQ_GATEWAY_BATCH_POLL_S": "0.5", "GENQ_GATEWAY_BATCH_LEASE_S": str(lease_s),
                    "GENQ_GATEWAY_BATCH_RESEND_AFTER_S": str(resend_after_s)}
        self.gateway: GatewayProcess | None = None
        self.gateways = 0
        self.kills_mid_batch = 0
        self.batch_id = ""

    def custom_id(self, index: int) -> str:
        return f"chaos-line-{index}"

    def prompt(self, index: int) -> str:
        return f"chaos batch {index}"

    def task_ids(self) -> dict[str, int]:
        """Each line's task id (docs/gateway.md: `<batch id>-<line index>`) and its index."""
        return {f"{self.batch_id}-{i}": i for i in range(self.lines)}

    def reference_requests(self) -> list[dict[str, Any]]:
        """Each line as the genq request the engine answers alone for its reference (greedy, as the line asks)."""
        return [{"prompt": self.prompt(i), "max_new_tokens": self.tokens, "ignore_eos": True, "identifier": identifier}
                for identifier, i in self.task_ids().items()]

    def start(self) -> None:
        """Start the gateway, upload the input file and create the batch."""
        self._start_gateway()
        body = [{"custom_id": self.custom_id(i), "method": "POST", "url": "/v1/completions",
                 "body": {"model": MODEL, "prompt": self.prompt(i), "max_tokens": self.tokens, "temperature": 0,
                          "ignore_eos": True}}
                for i in range(self.lines)]
        content = "".join(json.dumps(line) + "\n" for line in body).encode()
        client = self.client()
        upload = client.files.create(file=("chaos.jsonl", content), purpose="batch")
        self.batch_id = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                              completion_window="24h").id

    def client(self) -> openai.OpenAI:
        assert self.gateway is not None
        return openai.OpenAI(base_url=f"{self.gateway.url}/v1", api_key=TOKEN, max_retries=0, timeout=30)

    def _start_gateway(self) -> None:
        log_path = self.workdir / f"gateway{self.gateways}.log"
        self.gateways += 1
        self.gateway = GatewayProcess(self.env, log_path).start()

    def kill_gateway(self) -> None:
        """SIGKILL the gateway mid-batch and start another (on another port): it takes the batch over."""
        assert self.gateway is not None
        self.kills_mid_batch += not self.ended()
        log.info("chaos: SIGKILL the gateway")
        self.gateway.signal(signal.SIGKILL)
        self.gateway.wait()
        self._start_gateway()

    def check_gateway(self) -> str | None:
        """The gateway's log tail if it exited on its own."""
        if self.gateway is not None and not self.gateway.running():
            return self.gateway.log_tail()
        return None

    def answered(self) -> int:
        """Lines whose task has a final result (0 while Redis is away)."""
        try:
            client = redis.Redis.from_url(self.redis_url, socket_timeout=5)
            metas = client.mget([f"celery-task-meta-{identifier}" for identifier in self.task_ids()])
        except redis.RedisError:
            return 0
        return sum(meta is not None and json.loads(meta)["status"] in states.READY_STATES for meta in metas)

    def ended(self) -> bool:
        """Whether the batch has a final status (False while the gateway or Redis is away)."""
        try:
            return self.client().batches.retrieve(self.batch_id).status in ENDED
        except openai.APIError:
            return False

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop(30)

    def score(self, texts: dict[str, str], ended_twice: list[str], redelivered: int) -> BatchFigures:
        """The batch's figures: `texts` is each custom_id's reference text, `ended_twice` the
        custom_ids whose task has more than one final event, `redelivered` how many lines' tasks
        were delivered more than once."""
        client = self.client()
        batch = client.batches.retrieve(self.batch_id)
        counts = batch.request_counts
        figures = BatchFigures(lines=self.lines, status=batch.status, completed=counts.completed if counts else 0,
                               failed=counts.failed if counts else 0, redelivered=redelivered,
                               gateway_kills_mid_batch=self.kills_mid_batch)
        answers = [json.loads(line) for file_id in (batch.output_file_id, batch.error_file_id) if file_id
                   for line in client.files.content(file_id).text.splitlines()]
        seen = Counter(answer["custom_id"] for answer in answers)
        for index in range(self.lines):
            custom_id = self.custom_id(index)
            if seen[custom_id] == 0:
                figures.lost.append(custom_id)
            if seen[custom_id] > 1 or custom_id in ended_twice:
                figures.repeated.append(custom_id)
        for answer in answers:
            problem = self._problem(answer, texts)
            if problem is not None:
                figures.wrong_answers.append(answer["custom_id"])
                log.warning("chaos: batch line %s: %s", answer["custom_id"], problem)
        return figures

    def _problem(self, answer: dict[str, Any], texts: dict[str, str]) -> str | None:
        """Why an answer line is wrong, or None."""
        response = answer.get("response") or {}
        index = {self.custom_id(i): i for i in range(self.lines)}.get(answer["custom_id"])
        if index is None:
            return "not a custom_id of the input file"
        if response.get("status_code") != 200 or answer.get("error") is not None:
            return f"answered {response.get('status_code')}: {answer.get('error') or response.get('body')}"
        if response.get("request_id") != f"{self.batch_id}-{index}":
            return f"answered by task {response.get('request_id')}"
        text, tokens = response["body"]["choices"][0]["text"], response["body"]["usage"]["completion_tokens"]
        if tokens != self.tokens or text != texts[answer["custom_id"]]:
            return f"answered {text!r} ({tokens} tokens), the engine gives {texts[answer['custom_id']]!r}"
        return None
