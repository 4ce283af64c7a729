"""Fair admission between tenants: the scheduler's waiting queue (docs/engine.md, Fair share).

Waiting sequences are grouped by priority class (the job's priority, lower first) and, within a
class, by tenant (Job.tenant; None is the default tenant). A more urgent class is always offered
first. Within a class the tenants share admission by weighted fair queueing over tokens, in the
virtual-token-counter form of Sheng et al. ("Fairness in Serving Large Language Models", OSDI
2024): each active tenant has a counter of the tokens the engine computed for it (prompt chunks
and generated tokens, charged as each step completes) divided by its weight, and the next
admission goes to the tenant with the lowest counter. A tenant is forgotten once it has nothing
waiting or running (which bounds the state by the tenants in flight) and becomes active again
with the lowest counter of those active then, so time spent idle is no credit to spend later.
Ties go to the tenant with fewer running sequences, then to the earlier arrival.

Within one admission pass a tenant's counter is advanced by what each sequence offered to it
still has to prefill, so one pass interleaves tenants instead of offering one tenant's whole
backlog first. Sequences of one tenant and class keep their order (arrival; a preempted or
rewound one goes back to the front).
"""

from __future__ import annotations

import heapq
import math
import re
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence

MAX_TENANT_WEIGHT = 1000.0
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
"""The wire protocol's identifier pattern (producer/protocol.py), which a tenant name follows."""


@dataclass(slots=True)
class _Tenant:
    weight: float
    counter: float
    running: int = 0
    waiting: dict[int, deque[Sequence]] = field(default_factory=dict)  # priority class -> FIFO

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting


def check_weights(weights: Mapping[str, float], name: str = "tenant_weights") -> dict[str, float]:
    """The weights as a dict; ValueError naming the setting (name), the tenant and the bound it breaks."""
    checked = {}
    for tenant, weight in weights.items():
        if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
            raise ValueError(f"{name}: tenant name {tenant!r} must match {TENANT_NAME.pattern}")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) \
                or not 0 < weight <= MAX_TENANT_WEIGHT:
            raise ValueError(f"{name}: weight of {tenant!r} must be a number in (0, {MAX_TENANT_WEIGHT:g}], "
                             f"got {weight!r}")
        checked[tenant] = float(weight)
    return checked


class FairQueue:
    """The waiting sequences, offered in fair order (iteration), and the tenants' counters.

    The scheduler tells it when a sequence starts running (started), stops running without
    finishing its wait (stopped: finished, cancelled, preempted, rewound) and what each step
    computed (charge)."""

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights = check_weights(weights or {})
        self._tenants: dict[str | None, _Tenant] = {}
        self._classes: dict[int, set[str | None]] = {}  # priority class -> tenants with sequences waiting in it
        self._waiting: set[int] = set()  # serials
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, sequence: Sequence) -> bool:
        return sequence.serial in self._waiting

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence in the order admission offers them: by class, then fairly."""
        for priority in sorted(self._classes):
            yield from self._class_order(priority)

    def counter(self, tenant: str | None) -> float | None:
        """The tenant's weighted token counter; None while it is not active."""
        state = self._tenants.get(tenant)
        return None if state is None else state.counter

    def add(self, sequence: Sequence, front: bool = False) -> None:
        """Queue a sequence behind its tenant's others of its class (front: ahead of them)."""
        state = self._tenant(sequence.job.tenant)
        priority = sequence.job.priority
        queue = state.waiting.setdefault(priority, deque())
        if front:
            queue.appendleft(sequence)
        else:
            queue.append(sequence)
        self._classes.setdefault(priority, set()).add(sequence.job.tenant)
        self._waiting.add(sequence.serial)
        self._size += 1

    def remove(self, sequence: Sequence) -> None:
        """Take a waiting sequence out of the queue (it starts, or it ends while waiting)."""
        tenant, priority = sequence.job.tenant, sequence.job.priority
        state = self._tenants[tenant]
        queue = state.waiting[priority]
        if queue[0] is sequence:
            queue.popleft()
        else:
            queue.remove(sequence)
        self._waiting.discard(sequence.serial)
        self._size -= 1
        if not queue:
            del state.waiting[priority]
            tenants = self._classes[priority]
            tenants.discard(tenant)
            if not tenants:
                del self._classes[priority]
        self._forget_if_idle(tenant, state)

    def started(self, sequence: Sequence) -> None:
        """A waiting sequence was admitted: it leaves the queue and runs."""
        self._tenants[sequence.job.tenant].running += 1
        self.remove(sequence)

    def stopped(self, sequence: Sequence) -> None:
        """A running sequence stopped running (finished, cancelled, preempted or rewound)."""
        tenant = sequence.job.tenant
        state = self._tenants[tenant]
        state.running -= 1
        self._forget_if_idle(tenant, state)

    def running(self, tenant: str | None) -> int:
        """How many of the tenant's sequences run (0 for a tenant not active)."""
        state = self._tenants.get(tenant)
        return 0 if state is None else state.running

    def charge(self, sequence: Sequence, tokens: int) -> None:
        """Count tokens the engine computed for the sequence against its tenant (if still active)."""
        state = self._tenants.get(sequence.job.tenant)
        if state is not None:
            state.counter += tokens / state.weight

    def most_urgent(self) -> int | None:
        """The most urgent priority class with a sequence waiting."""
        return min(self._classes) if self._classes else None

    def _tenant(self, tenant: str | None) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            floor = min((t.counter for t in self._tenants.values()), default=0.0)
            weight = self.weights.get(tenant, 1.0) if tenant is not None else 1.0
            state = self._tenants[tenant] = _Tenant(weight, floor)
        return state

    def _forget_if_idle(self, tenant: str | None, state: _Tenant) -> None:
        if state.idle:
            del self._tenants[tenant]

    def _class_order(self, priority: int) -> Iterator[Sequence]:
        """One class's sequences, lowest (simulated) counter first; each offer advances its tenant's
        simulated counter by the sequence's uncomputed tokens over the tenant's weight."""
        heap: list[tuple[float, int, int, int, str | None]] = []
        queues: dict[str | None, tuple[Sequence, ...]] = {}
        weights: dict[str | None, float] = {}
        for tenant in self._classes.get(priority, ()):
            state = self._tenants[tenant]
            queue = queues[tenant] = tuple(state.waiting[priority])
            weights[tenant] = state.weight
            heap.append((state.counter, state.running, queue[0].serial, 0, tenant))
        heapq.heapify(heap)
        while heap:
            counter, running, _, index, tenant = heapq.heappop(heap)
            queue = queues[tenant]
            sequence = queue[index]
            yield sequence
            if index + 1 < len(queue):
                cost = max(1, len(sequence.token_ids) - sequence.num_computed) / weights[tenant]
                heapq.heappush(heap, (counter + cost, running + 1, queue[index + 1].serial, index + 1, tenant))
