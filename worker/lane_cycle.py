"""Which lists a worker's next BRPOP takes a task from, with tenant lanes on (issue 29).

kombu's Redis transport asks its queue cycle for the lists of each BRPOP (every list's priority-0
key first, then every list's priority-1 key, ...) and tells it which list each task came from.
kombu's round-robin cycle moves that list to the end, so lists with work take turns. LaneCycle
adds one rule: a list that already holds `limit` of this worker's tasks (concurrency less a
reserve) is left out of the next BRPOP, so one tenant's backlog can never hold every task slot,
and another tenant's task is taken as soon as it arrives instead of after the next task ends.

What a list holds is read from Celery's own record of the tasks the worker has taken and not yet
finished (celery.worker.state.reserved_requests, by each task's routing key: its queue), so a
task that ends in any way frees its list's place. A list left out comes back with the next
BRPOP, which the worker issues at least every LANE_POLL_S (kombu's brpop_timeout).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from celery.worker import state
from kombu.utils.scheduling import round_robin_cycle

LANE_POLL_S = 0.1
"""The BRPOP timeout with lanes on: how long a list left out at its limit may stay out after one
of its tasks ends (Redis >= 6 takes a fractional timeout)."""


class LaneCycle(round_robin_cycle):
    """kombu's round-robin queue cycle, leaving out the lists that hold `limit` tasks here."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def consume(self, n: int) -> list[str]:
        held = Counter(request.delivery_info.get("routing_key") for request in list(state.reserved_requests))
        return [queue for queue in self.items[:n] if held[queue] < self.limit]


def lane_cycle(concurrency: int, reserve: int) -> Callable[[], LaneCycle]:
    """The queue_order_strategy kombu builds each channel's cycle with (it takes a callable as it
    takes a class): each list may hold concurrency - reserve tasks, at least one."""
    limit = max(1, concurrency - reserve)
    return lambda: LaneCycle(limit)
