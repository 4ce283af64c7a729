"""The chaos run: many short tasks through real workers on a real redis-server
(append-only file on) while workers are SIGKILLed, Redis is killed -9 and
restarted gracefully, and poison messages are interleaved; then every task
is checked for a result and every stream for exactly one final event. With
`hostile_every`, hostile-but-valid requests (issue 23's kinds: extreme sampler
values, 20 top log-probabilities, 16 samples, slow-to-compile constraints, a
grammar over llguidance's limits, a regex cut by the compile budget) are
mixed in: each must end once, as its kind must (HOSTILE: the sampler's and
the big results succeed; a grammar past a limit fails with an error event
naming the limit), and every well-formed task must still finish with the
tokens the engine gives its prompt in this process. With `batch_lines`, an
OpenAI batch runs through a real gateway during the same chaos, and the
gateway too is SIGKILLed and restarted (tests/chaos_batch.py): the batch must
complete with every line answered once, with its prompt's text.

Used by tests/test_chaos.py (a small run in the default suite, the full one
behind `make chaos`); `python -m tests.chaos` runs it by hand and prints the
figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery, states

from engine import Generator
from engine.outputs import EngineOutput
from producer import protocol
from producer.protocol import TASK_NAME, GenerationRequest, StreamEvent, stream_key
from producer.watchdog import Watchdog
from tests.chaos_batch import BatchFigures, ChaosBatch
from tests.engine_runs import run as run_jobs
from tests.service import RawPublisher, plain_client, replay
from worker.jobs import build_job
from worker.processes import RedisServer, WorkerProcess

log = logging.getLogger(__name__)
QUEUE = "genq-chaos"
MAX_NEW_TOKENS = 4


@dataclass(frozen=True)
class ChaosPlan:
    tasks: int = 1000
    workers: int = 2
    worker_kills: int = 2
    redis_crashes: int = 1
    redis_restarts: int = 1
    poison_every: int = 10
    hostile_every: int = 0
    """0 = none; 20 = one hostile request after every 20 well-formed ones (5%)."""
    compile_timeout_s: float = 1.0
    """The workers' grammar compile budget: below the 2 s the full `(a{1000}){1000}` takes to
    start here (it then trips llguidance's initial_lexer_fuel), so that it is cut by the budget."""
    visibility_timeout_s: int = 30
    timeout_s: float = 900.0
    watchdog_after_s: float = 45.0
    batch_lines: int = 200
    """0 = no batch; else an OpenAI batch of this many completions, uploaded through a gateway at the start."""
    gateway_kills: int = 2
    batch_worker_kills: int = 1
    batch_redis_crashes: int = 1
    """The faults spread over the batch's lines answered (its lines run at the batch priority, below
    the tasks, so at a pace of their own): gateway SIGKILLs (each restarted), worker SIGKILLs, Redis
    kill -9s."""
    batch_line_tokens: int = 16
    """Longer than a task's, so that a line is often mid-generation when a worker is killed."""
    batch_lease_s: float = 3.0
    batch_resend_after_s: float = 30.0


@dataclass
class ChaosFigures:
    """What a run counts. The lists of request ids name the tasks', the hostile requests' and the
    batch lines' tasks alike; `batch` has the batch's own figures."""

    tasks: int = 0
    poison_messages: int = 0
    hostile_requests: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated_final_results: list[str] = field(default_factory=list)
    bad_streams: list[str] = field(default_factory=list)
    wrong_results: list[str] = field(default_factory=list)
    wrong_hostile_outcomes: list[str] = field(default_factory=list)
    redelivered: int = 0
    watchdog_resends: int = 0
    worker_kills: int = 0
    redis_crashes: int = 0
    redis_restarts: int = 0
    gateway_kills: int = 0
    batch: BatchFigures | None = None
    unexpected_worker_exits: list[str] = field(default_factory=list)
    """Worker nodes, and "gateway", that exited though not killed by the run."""
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The figures with each list of request ids (or worker nodes) as its length; the batch's
        prefixed `batch_`."""
        figures = asdict(self)
        batch = figures.pop("batch") or {}
        figures.update({f"batch_{name}": value for name, value in batch.items()})
        return {name: len(value) if isinstance(value, list) else value for name, value in figures.items()}


def _wide_schema(properties: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(properties)},
            "required": ["p0"]}


def _chain_grammar(rules: int) -> str:
    """A GBNF of `rules` rules, each referring to the next."""
    lines = [f'r{i} ::= "x" r{i + 1} | "y"' for i in range(rules)]
    return "\n".join(["root ::= r0", *lines, f'r{rules} ::= "z"'])


def _wide_grammar(alternatives: int) -> str:
    """A Lark grammar of one rule with `alternatives` alternatives: past 2,000, llguidance's
    max_items_in_row limit trips on the first token (issue 23, item 5)."""
    return "start: " + " | ".join(f'"a{i}"' for i in range(alternatives))


COMPILE_BUDGET = "(compile_timeout_s)"
"""How the worker's error names its compile budget; a constraint cut by it fails alone."""


@dataclass(frozen=True)
class Hostile:
    """A valid request heavy on the sampler, the result size or constraint compilation, and how it
    may end: `errors` empty, it succeeds; otherwise it fails, its final event's error naming one
    of them (a limit)."""

    request: dict[str, Any]
    errors: tuple[str, ...] = ()
    may_be_cut: bool = False
    """Its constraint may also be cut by the workers' compile budget (the compile threads run at
    a lower priority, so a loaded machine stretches a start of 0.1 s past it); it then fails
    alone, naming the budget."""

    def problem(self, status: str, error: str | None) -> str | None:
        """Why a task of this kind that ended so ended wrongly, or None."""
        if status == "SUCCESS" and not self.errors:
            return None
        if status == "FAILURE" and error is not None and "\n" not in error:
            if any(name in error for name in self.errors) or (self.may_be_cut and COMPILE_BUDGET in error):
                return None
        return f"{status}: {error!r}"


HOSTILE: list[Hostile] = [
    Hostile({"max_new_tokens": 16, "sampling": {
        "temperature": protocol.MAX_TEMPERATURE, "dry_multiplier": protocol.MAX_DRY_MULTIPLIER,
        "dry_base": protocol.MAX_DRY_BASE, "dry_allowed_length": 1,
        "repetition_penalty": protocol.MAX_REPETITION_PENALTY, "frequency_penalty": protocol.MAX_ABS_PENALTY,
        "presence_penalty": -protocol.MAX_ABS_PENALTY, "smoothing_factor": protocol.MAX_SMOOTHING_FACTOR}}),
    Hostile({"max_new_tokens": 16, "sampling": {"temperature": protocol.MIN_SAMPLED_TEMPERATURE, "mirostat": True,
                                                "mirostat_tau": protocol.MAX_MIROSTAT_TAU,
                                                "mirostat_eta": protocol.MAX_MIROSTAT_ETA,
                                                "token_bias": {str(t): protocol.MAX_TOKEN_BIAS_VALUE
                                                               for t in range(8)}}}),
    Hostile({"max_new_tokens": 64, "ignore_eos": True, "logprobs": True, "top_logprobs": protocol.MAX_TOP_LOGPROBS}),
    Hostile({"max_new_tokens": 32, "ignore_eos": True, "n": protocol.MAX_N, "sampling": {"temperature": 1.0}}),
    Hostile({"max_new_tokens": 8, "constraint": {"type": "regex", "pattern": "(a{40}){40}"}}, may_be_cut=True),
    Hostile({"max_new_tokens": 8, "constraint": {"type": "json_schema", "json_schema": _wide_schema(1000)}},
            may_be_cut=True),
    Hostile({"max_new_tokens": 8, "constraint": {"type": "grammar", "syntax": "gbnf",
                                                 "grammar": _chain_grammar(400)}}, may_be_cut=True),
    Hostile({"max_new_tokens": 8, "constraint": {"type": "grammar", "syntax": "lark", "grammar": _wide_grammar(3000)}},
            errors=("constraint: lark: over llguidance's max_items_in_row limit (2000)",), may_be_cut=True),
    # Cut by the compile budget; a worker that already started it (the start runs on after the
    # cut) fails it at once with llguidance's own limit.
    Hostile({"max_new_tokens": 8, "constraint": {"type": "regex", "pattern": "(a{1000}){1000}"}},
            errors=(COMPILE_BUDGET, "constraint: regex: over llguidance's initial_lexer_fuel limit")),
]
"""Valid requests that are heavy on the sampler, the result size or constraint compilation, or
past one of llguidance's limits, sent in this order, round and round; each is checked valid
against the protocol by tests/test_chaos.py."""


def poison_message(i: int) -> tuple[Any, dict[str, Any]]:
    """Issue 17's two poison messages, alternately: a body that is an object, a message without an id."""
    if i % 2 == 0:
        return {"prompt": "poison"}, {"task": TASK_NAME, "id": f"poison-{i}"}
    return [[], {"prompt": "poison"}, {}], {"task": TASK_NAME}


class Chaos:
    def __init__(self, model: Path, workdir: Path, plan: ChaosPlan) -> None:
        self.model = model
        self.workdir = workdir
        self.plan = plan
        self.redis = RedisServer(workdir / "redis")
        self.workers: list[WorkerProcess] = []
        self.figures = ChaosFigures(tasks=plan.tasks)
        self.ids = [f"chaos-{i}" for i in range(plan.tasks)]
        self.hostile_ids: list[str] = []
        self.batch = ChaosBatch(self.redis.url, QUEUE, workdir, plan.batch_lines, plan.batch_line_tokens,
                                plan.batch_lease_s, plan.batch_resend_after_s) if plan.batch_lines else None
        self._started = 0

    def start_worker(self) -> WorkerProcess:
        name = f"chaos{self._started}"
        self._started += 1
        worker = WorkerProcess(self.model, self.redis.url, QUEUE, name, self.workdir / f"{name}.log",
                               {"visibility_timeout": self.plan.visibility_timeout_s, "concurrency": 32,
                                "cache_tokens": 4096, "page_size": 16, "shutdown_grace": 0,
                                "compile_timeout_s": self.plan.compile_timeout_s})
        self.workers.append(worker.start())
        return worker

    def run(self) -> ChaosFigures:
        started = time.monotonic()
        self.redis.start()
        try:
            self._run()
        finally:
            if self.batch is not None:
                self.batch.stop()
            for worker in self.workers:
                worker.stop(30)
            self.redis.stop()
        self.figures.wall_s = round(time.monotonic() - started, 1)
        return self.figures

    def _run(self) -> None:
        client = plain_client(self.redis.url)
        for _ in range(self.plan.workers):
            self.start_worker().wait_ready(client)
        watchdog = Watchdog(client, redis.Redis.from_url(self.redis.url), self.plan.watchdog_after_s)
        if self.batch is not None:
            self.batch.start()
        self._send(client, watchdog)
        schedule = self._schedule()
        batch_schedule = self._batch_schedule()
        deadline = time.monotonic() + self.plan.timeout_s
        while time.monotonic() < deadline:
            done = self._finished()
            while schedule and done >= schedule[0][0]:
                _, action = schedule.pop(0)
                action()
            answered = self.batch.answered() if self.batch is not None else 0
            while batch_schedule and answered >= batch_schedule[0][0]:
                _, action = batch_schedule.pop(0)
                action()
            if done == len(self.ids) + len(self.hostile_ids) and not schedule and not batch_schedule and (
                    self.batch is None or self.batch.ended()):
                break
            self._check_workers()
            self._watch(watchdog)
            time.sleep(0.5)
        self._check_workers()
        self.figures.watchdog_resends = watchdog.resent
        self._score()

    def _watch(self, watchdog: Watchdog) -> None:
        try:
            watchdog.check()
        except redis.RedisError:
            log.info("chaos: the watchdog could not reach Redis; next round")

    def _send(self, client: Celery, watchdog: Watchdog) -> None:
        raw = RawPublisher(self.redis.url)
        try:
            for i, identifier in enumerate(self.ids):
                kwargs = well_formed(i, identifier)
                client.send_task(TASK_NAME, kwargs=kwargs, task_id=identifier, queue=QUEUE)
                watchdog.track(identifier, kwargs, QUEUE)
                if self.plan.hostile_every and i % self.plan.hostile_every == self.plan.hostile_every - 1:
                    self._send_hostile(client, watchdog)
                if self.plan.poison_every and i % self.plan.poison_every == 0:
                    raw.publish(QUEUE, *poison_message(self.figures.poison_messages))
                    self.figures.poison_messages += 1
        finally:
            raw.close()

    def _send_hostile(self, client: Celery, watchdog: Watchdog) -> None:
        n = len(self.hostile_ids)
        identifier = f"hostile-{n}"
        kwargs = {**HOSTILE[n % len(HOSTILE)].request, "prompt": f"hostile {n}", "identifier": identifier}
        client.send_task(TASK_NAME, kwargs=kwargs, task_id=identifier, queue=QUEUE)
        watchdog.track(identifier, kwargs, QUEUE)
        self.hostile_ids.append(identifier)
        self.figures.hostile_requests += 1

    def _schedule(self) -> list[tuple[int, Callable[[], None]]]:
        """Faults at fixed fractions of the tasks finished, spread over the run."""
        return _spread([self._kill_worker] * self.plan.worker_kills + [self._crash_redis] * self.plan.redis_crashes
                       + [self._restart_redis] * self.plan.redis_restarts, self.plan.tasks)

    def _batch_schedule(self) -> list[tuple[int, Callable[[], None]]]:
        """Faults at fixed fractions of the batch's lines answered."""
        if self.batch is None:
            return []
        return _spread([self._kill_gateway] * self.plan.gateway_kills
                       + [self._kill_worker] * self.plan.batch_worker_kills
                       + [self._crash_redis] * self.plan.batch_redis_crashes, self.plan.batch_lines)

    def _kill_gateway(self) -> None:
        assert self.batch is not None
        self.batch.kill_gateway()
        self.figures.gateway_kills += 1

    def _kill_worker(self) -> None:
        victim = next(w for w in self.workers if w.process is not None and w.process.poll() is None)
        log.info("chaos: SIGKILL %s", victim.node)
        victim.kill()
        self.figures.worker_kills += 1
        self.start_worker()

    def _crash_redis(self) -> None:
        log.info("chaos: kill -9 redis-server")
        self.redis.restart(graceful=False)
        self.figures.redis_crashes += 1

    def _restart_redis(self) -> None:
        log.info("chaos: graceful redis-server restart")
        self.redis.restart(graceful=True)
        self.figures.redis_restarts += 1

    def _check_workers(self) -> None:
        for worker in self.workers:
            code = worker.process.poll() if worker.process is not None else None
            killed = code == -9
            if code is not None and not killed and worker.node not in self.figures.unexpected_worker_exits:
                log.error("worker %s exited with %s:\n%s", worker.node, code, worker.log_tail())
                self.figures.unexpected_worker_exits.append(worker.node)
        if self.batch is not None and (tail := self.batch.check_gateway()) is not None \
                and "gateway" not in self.figures.unexpected_worker_exits:
            log.error("the gateway exited:\n%s", tail)
            self.figures.unexpected_worker_exits.append("gateway")

    def _finished(self) -> int:
        """Tasks with a final result stored (STARTED is stored too: task_track_started)."""
        try:
            client = redis.Redis.from_url(self.redis.url, socket_timeout=5)
            metas = client.mget([f"celery-task-meta-{identifier}" for identifier in self.ids + self.hostile_ids])
        except redis.RedisError:
            return 0
        return sum(meta is not None and json.loads(meta)["status"] in states.READY_STATES for meta in metas)

    def _score(self) -> None:
        client = redis.Redis.from_url(self.redis.url)
        requests = [well_formed(i, identifier) for i, identifier in enumerate(self.ids)]
        lines = self.batch.task_ids() if self.batch is not None else {}
        requests += self.batch.reference_requests() if self.batch is not None else []
        references = reference_outputs(self.model, requests)
        wanted = {request["identifier"]: request["max_new_tokens"] for request in requests}
        expected = {identifier: output.completion_ids or [] for identifier, output in references.items()}
        ids = self.ids + self.hostile_ids + list(lines)
        redelivered_lines = 0
        metas = client.mget([f"celery-task-meta-{identifier}" for identifier in ids])
        for identifier, meta in zip(ids, metas, strict=True):
            events = replay(client, identifier) if client.exists(stream_key(identifier)) else []
            finals = [e for e in events if e.is_terminal]
            result = json.loads(meta) if meta is not None else {"status": "PENDING"}
            if result["status"] not in states.READY_STATES:
                self.figures.lost.append(identifier)
                continue
            if identifier in expected and (
                    result["status"] != "SUCCESS"
                    or result["result"]["usage"]["completion_tokens"] != wanted[identifier]
                    or result["result"]["token_ids"] != expected[identifier]):
                self.figures.wrong_results.append(identifier)
                log.warning("chaos: %s ended %s: %s", identifier, result["status"], result["result"])
            if len(finals) > 1:
                self.figures.duplicated_final_results.append(identifier)
                log.warning("chaos: %s has %d final events: %s", identifier, len(finals),
                            [(e.attempt, e.seq, e.event) for e in events])
            if not _ends_in_one_final(events):
                self.figures.bad_streams.append(identifier)
            elif identifier in self.hostile_ids:
                kind = HOSTILE[self.hostile_ids.index(identifier) % len(HOSTILE)]
                problem = kind.problem(result["status"], events[-1].error)
                if problem is not None:
                    self.figures.wrong_hostile_outcomes.append(identifier)
                    log.warning("chaos: %s ended wrongly for its kind: %s", identifier, problem)
            self.figures.redelivered += any(e.attempt > 1 for e in events)
            redelivered_lines += identifier in lines and any(e.attempt > 1 for e in events)
        if self.batch is not None:
            texts = {self.batch.custom_id(index): references[identifier].full_completion or ""
                     for identifier, index in lines.items()}
            twice = [self.batch.custom_id(lines[i]) for i in self.figures.duplicated_final_results if i in lines]
            self.figures.batch = self.batch.score(texts, twice, redelivered_lines)


def _spread(actions: list[Callable[[], None]], total: int) -> list[tuple[int, Callable[[], None]]]:
    """Each action with the count of work done at which it runs: at fixed fractions of `total`, kinds alternating."""
    order = sorted(range(len(actions)), key=lambda i: (i % 2, i))
    step = total // (len(actions) + 1)
    return [(step * (n + 1), actions[i]) for n, i in enumerate(order)]


def well_formed(i: int, identifier: str) -> dict[str, Any]:
    return {"prompt": f"chaos {i}", "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "identifier": identifier}


def reference_outputs(model: Path, requests: list[dict[str, Any]]) -> dict[str, EngineOutput]:
    """Each well-formed request's greedy result from the engine in this process, as the worker builds its job."""
    generator = Generator.from_pretrained(model, cache_tokens=4096, page_size=16)
    jobs = [build_job(GenerationRequest.parse_payload(r), generator.tokenizer, r["identifier"],
                         generator.model.config.vocab_size)
            for r in requests]
    finals: dict[str, EngineOutput] = {}
    for start in range(0, len(jobs), generator.max_pending):  # more than the engine queues at once
        finals.update(run_jobs(generator, jobs[start:start + generator.max_pending]))
    return finals


def _ends_in_one_final(events: list[StreamEvent]) -> bool:
    finals = [i for i, e in enumerate(events) if e.is_terminal]
    return len(finals) == 1 and finals[0] == len(events) - 1


def run_chaos(model: Path, workdir: Path, plan: ChaosPlan) -> ChaosFigures:
    return Chaos(model, workdir, plan).run()


def main() -> int:
    parser = argparse.ArgumentParser(description="Run the chaos test's workload by hand and print its figures.")
    parser.add_argument("model", type=Path, help="HF model directory (e.g. one from `genq make-tiny-model`)")
    parser.add_argument("workdir", type=Path, help="where Redis's append-only file and the worker logs go")
    parser.add_argument("--tasks", type=int, default=ChaosPlan.tasks)
    parser.add_argument("--worker-kills", type=int, default=ChaosPlan.worker_kills)
    parser.add_argument("--redis-crashes", type=int, default=ChaosPlan.redis_crashes, help="kill -9 and restart")
    parser.add_argument("--redis-restarts", type=int, default=ChaosPlan.redis_restarts, help="graceful restarts")
    parser.add_argument("--hostile-every", type=int, default=ChaosPlan.hostile_every,
                        help="one hostile-but-valid request after every N tasks (0 = none)")
    parser.add_argument("--batch-lines", type=int, default=ChaosPlan.batch_lines,
                        help="lines of the OpenAI batch run through a gateway (0 = none)")
    parser.add_argument("--gateway-kills", type=int, default=ChaosPlan.gateway_kills)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    plan = ChaosPlan(tasks=args.tasks, worker_kills=args.worker_kills, redis_crashes=args.redis_crashes,
                     redis_restarts=args.redis_restarts, hostile_every=args.hostile_every,
                     batch_lines=args.batch_lines, gateway_kills=args.gateway_kills)
    figures = run_chaos(args.model, args.workdir, plan)
    print(json.dumps(figures.summary(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
