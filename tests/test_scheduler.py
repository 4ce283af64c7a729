"""The scheduler as pure policy over hand-built sequences: order and budget,
admission, preemption, bounded skips, draft room, and that nothing advances
until update_from_output."""

from __future__ import annotations

import dataclasses

import pytest

from engine.kv_manager import KVManager
from engine.scheduler import Scheduler, SchedulerOutput
from tests.kv_fixtures import make_sequence

PAGE = 4


def scheduler(num_pages: int = 64, max_batch_size: int = 8, max_chunk_size: int = 16, **options) -> Scheduler:
    return Scheduler(KVManager(num_pages, PAGE, prefix_caching=False), max_batch_size, max_chunk_size, **options)


def finish_step(s: Scheduler, out: SchedulerOutput, finished=(), accepted=None) -> None:
    """What the generator does after a forward: one token per sampling sequence."""
    for item in out.scheduled:
        if item.samples and item.sequence not in finished:
            item.sequence.append(7)
    s.update_from_output(out, accepted or {}, finished)


def test_decodes_go_first_then_prefill_chunks_then_admissions_within_the_budget():
    s = scheduler(max_chunk_size=16)
    old = make_sequence(0, list(range(6)))
    s.add(old)
    finish_step(s, s.schedule())  # old's prompt in one chunk; it now decodes
    long = make_sequence(1, list(range(40)))
    s.add(long)
    out = s.schedule()
    assert [(i.sequence.serial, i.num_tokens) for i in out.scheduled] == [(0, 1), (1, 15)]
    finish_step(s, out)
    late = make_sequence(2, list(range(5)))
    s.add(late)
    out = s.schedule()
    # decode (1) + long's next chunk (15) fill the budget; late waits
    assert [(i.sequence.serial, i.num_tokens) for i in out.scheduled] == [(0, 1), (1, 15)]
    assert out.started == () and list(s.waiting) == [late]


def test_schedule_changes_nothing_until_update_from_output():
    s = scheduler()
    a = make_sequence(0, list(range(10)))
    s.add(a)
    out = s.schedule()
    assert out.started == (a,) and a.num_computed == 0 and len(a.pages) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.scheduled[0].num_tokens = 3  # type: ignore[misc]
    assert out.scheduled[0].samples
    finish_step(s, out)
    assert a.num_computed == 10 and len(a.token_ids) == 11


def test_finished_sequences_leave_and_free_their_pages():
    s = scheduler(num_pages=8)
    a, b = make_sequence(0, list(range(9))), make_sequence(1, list(range(3)))
    s.add(a)
    s.add(b)
    finish_step(s, s.schedule(), finished=[a])
    assert s.num_running == 1 and s.running == [b] and not a.pages
    assert s.kv.num_free == 8 - len(b.pages)


def test_newest_running_sequence_is_preempted_when_pages_run_out():
    s = scheduler(num_pages=4, max_chunk_size=32)
    a, b = make_sequence(0, list(range(7))), make_sequence(1, list(range(7)))
    s.add(a)
    s.add(b)
    finish_step(s, s.schedule())  # both prefilled: 2 pages each (all 4), each now holds 8 tokens
    finish_step(s, s.schedule())  # both decode position 7, still in their second page
    out = s.schedule()  # both decode position 8: a fresh page each, none is free
    assert [i.sequence for i in out.scheduled] == [a]
    assert out.preempted == (b,) and b.num_computed == 0 and b.pages == [] and next(iter(s.waiting)) is b
    assert s.num_preemptions == 1
    finish_step(s, out, finished=[a])
    out = s.schedule()  # b comes back and recomputes its prompt and its generated tokens
    assert [(i.sequence, i.num_tokens) for i in out.scheduled] == [(b, 9)]


def test_a_waiting_job_is_passed_over_at_most_max_skips_times():
    s = scheduler(num_pages=6, max_batch_size=8, max_chunk_size=64, max_skips=2)
    s.add(make_sequence(0, list(range(12))))  # 4 pages with its first token
    finish_step(s, s.schedule())
    big = make_sequence(1, list(range(12)))  # needs 4 pages, 2 are free
    s.add(big)
    small = [make_sequence(2 + i, [1]) for i in range(4)]
    for sequence in small:
        s.add(sequence)
    admitted = []
    for _ in range(3):
        out = s.schedule()
        admitted += [seq for seq in out.started]
        finish_step(s, out)
    # two small jobs overtook big (its skips reached max_skips); nothing overtakes it after that
    assert admitted == small[:2] and big.skips == 2 and list(s.waiting) == [big, *small[2:]]


def test_few_decoders_get_draft_room_and_rejected_drafts_give_pages_back():
    s = scheduler(num_draft_tokens=4, max_speculative_batch=1)
    a = make_sequence(0, list(range(7)), max_new_tokens=16)
    s.add(a)
    finish_step(s, s.schedule())
    out = s.schedule()
    item = out.scheduled[0]
    assert (item.num_tokens, item.draft_room) == (1, 4) and len(a.pages) == 3  # room up to position 11
    for token in (7, 8):  # one draft token accepted plus the model's own
        a.append(token)
    s.update_from_output(out, {0: 1}, ())
    assert a.num_computed == 8 + 1 and len(a.token_ids) == 10 and len(a.pages) == 3
    b = make_sequence(1, [1, 2])
    s.add(b)
    finish_step(s, s.schedule())
    out = s.schedule()  # two decoders > max_speculative_batch: no draft room
    assert all(i.draft_room == 0 for i in out.scheduled)
