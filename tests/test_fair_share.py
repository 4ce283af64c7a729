"""Fair admission between tenants (issue 29): the scheduler over hand-built sequences. Weighted
token shares over many steps, a newcomer admitted ahead of a flood's backlog and prefilled in a
step of its own (a new tenant, or a more urgent class; never two such steps in a row, never
ahead of a more urgent running class), no credit
banked while idle, priority classes first, and preemption of a running job for a strictly more
urgent class only; GENQ_TENANT_WEIGHTS and GENQ_NEWCOMER_FIRST reaching the generator's scheduler."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from engine import Generator
from engine.fair_share import FairQueue
from engine.job import Job
from engine.kv_manager import KVManager
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from worker.settings import Settings

PAGE = 4


class Jobs:
    """Sequences with increasing serials (arrival order), each of a tenant and a priority class."""

    def __init__(self) -> None:
        self.serial = 0

    def make(self, tenant: str | None, prompt: int = 4, max_new_tokens: int = 8, priority: int = 0) -> Sequence:
        job = Job(list(range(1, prompt + 1)), max_new_tokens, stop_conditions=[], priority=priority, tenant=tenant)
        job.serial = self.serial
        self.serial += 1
        return Sequence(job, job.serial, list(job.input_ids), prompt, 0.0)


def scheduler(num_pages: int = 256, max_batch_size: int = 4, max_chunk_size: int = 64, **options) -> Scheduler:
    return Scheduler(KVManager(num_pages, PAGE, prefix_caching=False), max_batch_size, max_chunk_size, **options)


def step(s: Scheduler) -> SchedulerOutput:
    """Schedule, then what the generator does: a token per sampling sequence; a sequence that has
    its max_new_tokens finishes."""
    out = s.schedule()
    finished = []
    for item in out.scheduled:
        if item.samples:
            item.sequence.append(7)
            if item.sequence.num_generated >= item.sequence.job.max_new_tokens:
                finished.append(item.sequence)
    s.update_from_output(out, {}, finished)
    return out


def test_token_shares_follow_the_tenants_weights_over_many_steps():
    s = scheduler(max_batch_size=3, tenant_weights={"heavy": 2.0})
    jobs = Jobs()
    for _ in range(80):
        s.add(jobs.make("heavy"))
        s.add(jobs.make("light"))
    computed: Counter[str | None] = Counter()
    for _ in range(200):
        for item in step(s).scheduled:
            computed[item.sequence.job.tenant] += item.num_tokens
    assert s.waiting  # both tenants still had work waiting the whole time
    assert computed["heavy"] / computed["light"] == pytest.approx(2.0, rel=0.1)


def test_equal_weights_share_tokens_equally_whatever_the_backlog():
    s = scheduler(max_batch_size=4)
    jobs = Jobs()
    for _ in range(300):
        s.add(jobs.make("flood"))
    for _ in range(10):
        s.add(jobs.make("trickle"))
    computed: Counter[str | None] = Counter()
    for _ in range(40):
        for item in step(s).scheduled:
            computed[item.sequence.job.tenant] += item.num_tokens
    assert computed["flood"] / computed["trickle"] == pytest.approx(1.0, rel=0.15)


def test_a_newcomer_takes_the_next_free_slot_ahead_of_a_flood_backlog():
    s = scheduler(max_batch_size=2)
    jobs = Jobs()
    flood = [jobs.make("flood", max_new_tokens=4 + i) for i in range(50)]
    for sequence in flood:
        s.add(sequence)
    step(s)
    step(s)
    newcomer = jobs.make("newcomer")
    s.add(newcomer)
    started = []
    while not started:
        started = list(step(s).started)
    assert started == [newcomer]  # the first slot freed goes to it, not to the 48 older flood jobs


def busy_with_flood(s: Scheduler, jobs: Jobs, running: int = 3) -> list[Sequence]:
    """`running` flood jobs decoding, more of them waiting for a slot."""
    flood = [jobs.make("flood", max_new_tokens=40) for _ in range(running)]
    for sequence in flood:
        s.add(sequence)
    step(s)
    step(s)
    return flood


def arrives_during_flood(tenant: str, prompt: int = 4, priority: int = 0, newcomer_first: bool = True
                         ) -> tuple[Scheduler, Sequence, SchedulerOutput]:
    """A job of `tenant` added while three flood jobs decode (4 slots), and the step that follows."""
    s = scheduler(max_batch_size=4, newcomer_first=newcomer_first)
    jobs = Jobs()
    busy_with_flood(s, jobs)
    arrival = jobs.make(tenant, prompt=prompt, priority=priority)
    s.add(arrival)
    return s, arrival, step(s)


def tenants_of(out: SchedulerOutput) -> list[str | None]:
    return [item.sequence.job.tenant for item in out.scheduled]


def test_a_newcomer_is_prefilled_in_a_step_of_its_own_then_decodes_beside_the_flood():
    s, newcomer, out = arrives_during_flood("newcomer", prompt=9)
    assert out.started == (newcomer,) and tenants_of(out) == ["newcomer"]  # the flood's rows skip it
    assert out.scheduled[0].num_tokens == 9 and out.scheduled[0].samples
    assert sorted(map(str, tenants_of(step(s)))) == ["flood", "flood", "flood", "newcomer"]


def test_without_newcomer_first_the_newcomers_prefill_shares_the_flood_step():
    _, newcomer, out = arrives_during_flood("newcomer", newcomer_first=False)
    assert out.started == (newcomer,) and tenants_of(out) == ["flood", "flood", "flood", "newcomer"]


def test_newcomer_steps_never_follow_each_other_so_running_jobs_keep_decoding():
    s = scheduler(max_batch_size=64)
    jobs = Jobs()
    flood = busy_with_flood(s, jobs)
    decoded = []
    for i in range(10):  # a new tenant arrives before every step
        s.add(jobs.make(f"newcomer{i}"))
        decoded.append(flood[0] in [item.sequence for item in step(s).scheduled])
    assert decoded == [False, True] * 5


def test_a_newcomer_of_a_less_urgent_class_waits_for_a_mixed_step():
    _, batch_line, out = arrives_during_flood("batch", priority=5)
    assert out.started == (batch_line,) and len(out.scheduled) == 4  # admitted beside the decodes


def test_a_more_urgent_class_gets_a_step_of_its_own_even_from_a_tenant_that_runs_jobs():
    s = scheduler(max_batch_size=4)
    jobs = Jobs()
    lines = [jobs.make(None, max_new_tokens=40, priority=9) for _ in range(3)]  # a batch's lines
    for sequence in lines:
        s.add(sequence)
    step(s)
    interactive = jobs.make(None, priority=0)
    s.add(interactive)
    out = step(s)
    assert out.started == (interactive,) and [item.sequence for item in out.scheduled] == [interactive]


def test_a_tenant_that_already_runs_gets_no_step_of_its_own():
    _, more, out = arrives_during_flood("flood")
    assert out.started == (more,) and len(out.scheduled) == 4


def test_time_spent_idle_is_no_credit():
    s = scheduler(max_batch_size=3)
    jobs = Jobs()
    s.add(jobs.make("returning", max_new_tokens=1))
    s.add(jobs.make("steady", max_new_tokens=200))
    step(s)
    assert s.waiting.counter("returning") is None  # finished and forgotten
    for _ in range(30):
        step(s)
    steady = s.waiting.counter("steady")
    assert steady is not None and steady > 30
    for _ in range(8):
        s.add(jobs.make("steady", max_new_tokens=4))
        s.add(jobs.make("returning", max_new_tokens=4))
    assert s.waiting.counter("returning") == steady  # back at the busy tenant's counter, not at 0
    order = [sequence.job.tenant for _ in range(12) for sequence in step(s).started]
    # it takes its share of the two free slots instead of every slot until it has caught up
    assert 2 <= order[:8].count("steady") <= 6


def test_a_more_urgent_class_is_admitted_first_whatever_the_tenants_counters():
    s = scheduler(max_batch_size=1)
    jobs = Jobs()
    busy = jobs.make("busy", max_new_tokens=2)
    s.add(busy)
    step(s)
    step(s)  # busy's counter is now ahead of any newcomer's
    relaxed = jobs.make("fresh", priority=5)
    urgent = jobs.make("busy", priority=1)
    s.add(relaxed)
    s.add(urgent)
    assert list(s.waiting) == [urgent, relaxed]
    started = [sequence for _ in range(4) for sequence in step(s).started]
    assert started[:1] == [urgent]


def test_a_full_batch_preempts_the_newest_of_the_least_urgent_class_for_a_more_urgent_job():
    s = scheduler(max_batch_size=3)
    jobs = Jobs()
    older, newer = jobs.make("a", max_new_tokens=50, priority=5), jobs.make("a", max_new_tokens=50, priority=5)
    middle = jobs.make("b", max_new_tokens=50, priority=3)
    for sequence in (older, newer, middle):
        s.add(sequence)
    step(s)
    urgent = jobs.make("c", priority=0)
    s.add(urgent)
    out = step(s)
    assert out.preempted == (newer,) and out.started == (urgent,)
    assert newer.num_computed == 0 and newer.pages == [] and newer in s.waiting
    assert s.num_preemptions == 1
    same_class = jobs.make("d", priority=5)
    s.add(same_class)
    out = step(s)
    assert out.preempted == () and same_class in s.waiting  # never preempted for its own class


def test_pages_running_out_preempt_for_a_more_urgent_job_too():
    s = scheduler(num_pages=6, max_batch_size=8)
    jobs = Jobs()
    relaxed = [jobs.make("a", prompt=7, max_new_tokens=50, priority=2) for _ in range(3)]
    for sequence in relaxed:
        s.add(sequence)
    step(s)  # 2 pages each: none free
    urgent = jobs.make("b", prompt=7, priority=1)
    s.add(urgent)
    out = step(s)
    assert out.preempted == (relaxed[2],) and out.started == (urgent,)


def test_tenant_weights_out_of_bounds_are_refused_naming_the_tenant_and_the_limit():
    with pytest.raises(ValueError, match=r"tenant_weights: weight of 'a' must be a number in \(0, 1000\], got 0"):
        FairQueue({"a": 0})
    with pytest.raises(ValueError, match=r"tenant_weights: tenant name 'a b' must match"):
        FairQueue({"a b": 1.0})


def test_the_workers_tenant_weights_and_newcomer_first_reach_the_generators_scheduler(llama_dir: Path):
    config = Settings(tenant_weights="acme=2, globex=0.5", newcomer_first=False).engine_config()
    assert config.scheduler.tenant_weights == {"acme": 2.0, "globex": 0.5}
    generator = Generator.from_pretrained(llama_dir, config=config, cache_tokens=256)
    assert generator.scheduler.waiting.weights == {"acme": 2.0, "globex": 0.5}
    assert not generator.scheduler.newcomer_first and Settings().engine_config().scheduler.newcomer_first
    with pytest.raises(ValueError, match=r"GENQ_TENANT_WEIGHTS: 'acme' is not NAME=WEIGHT"):
        Settings(tenant_weights="acme")


def test_no_job_is_preempted_when_even_all_less_urgent_pages_would_not_make_room():
    s = scheduler(num_pages=6, max_batch_size=8)
    jobs = Jobs()
    urgent_running = jobs.make("a", prompt=7, max_new_tokens=50, priority=0)
    relaxed = jobs.make("b", prompt=3, max_new_tokens=50, priority=5)
    s.add(urgent_running)
    s.add(relaxed)
    step(s)  # 2 + 1 pages held, 3 free
    big = jobs.make("c", prompt=22, priority=1)  # needs 6 pages: 3 free + relaxed's 1 are not enough
    s.add(big)
    out = step(s)
    assert out.preempted == () and relaxed in s.running and big in s.waiting
