"""Using the generator from asyncio code in the same process, as exllamav2's
ExLlamaV2DynamicGeneratorAsync / ExLlamaV2DynamicJobAsync do:

    agen = AsyncGenerator(generator)
    job = agen.submit(Job(ids, 64))
    async for result in job:          # started / streaming / eos results of this job
        ...
    await agen.close()

iterate() never runs on the event loop: a driver task runs each step in a
worker thread (asyncio.to_thread) while any job is active, and hands every
result to its job's queue on the loop. New jobs and cancellations are only
recorded on the loop (a lock held for a list append); the step's thread
applies them between two iterate() calls, as the Celery worker's engine loop
does, so the loop never waits for a step to finish.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from engine.errors import JobRejected, QueueFull
from engine.generator import Generator
from engine.job import Job
from engine.outputs import EngineOutput


class AsyncJob:
    """One submitted job: iterate it for its results; the eos result is the last."""

    def __init__(self, owner: AsyncGenerator, job: Job) -> None:
        self.job = job
        self._owner = owner
        self._queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self._done = False

    def __aiter__(self) -> AsyncJob:
        return self

    async def __anext__(self) -> EngineOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.eos
        return item

    async def cancel(self) -> None:
        """Stop the job; its last result (eos_reason cancelled) still arrives through iteration."""
        self._owner._request_cancel(self.job)


class AsyncGenerator:
    def __init__(self, generator: Generator) -> None:
        self.generator = generator
        self._lock = threading.Lock()
        self._inbox: list[AsyncJob] = []
        self._cancels: list[Job] = []
        self._active: dict[int, AsyncJob] = {}  # id(job) -> its AsyncJob; changed under the lock
        self._driver: asyncio.Task[None] | None = None

    def submit(self, job: Job) -> AsyncJob:
        """Queue a job (enqueued between two steps); a JobRejected or QueueFull is raised by iterating it."""
        async_job = AsyncJob(self, job)
        with self._lock:
            self._inbox.append(async_job)
        self._ensure_driver()
        return async_job

    async def close(self) -> None:
        """Cancel every job and wait for the driver to finish."""
        with self._lock:
            self._cancels += [async_job.job for async_job in self._active.values()]
            self._cancels += [async_job.job for async_job in self._inbox]
        if self._driver is not None:
            await self._driver

    def _request_cancel(self, job: Job) -> None:
        with self._lock:
            self._cancels.append(job)
        self._ensure_driver()

    def _ensure_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())

    def _busy(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._cancels or self._active)

    async def _drive(self) -> None:
        while self._busy():
            refused, results = await asyncio.to_thread(self._step)
            for refused_job, error in refused:
                refused_job._queue.put_nowait(error)
            for result in results:
                with self._lock:
                    async_job = self._active.get(id(result.job))
                    if result.eos:
                        self._active.pop(id(result.job), None)
                if async_job is not None:
                    async_job._queue.put_nowait(result)

    def _step(self) -> tuple[list[tuple[AsyncJob, Exception]], list[EngineOutput]]:
        """In the worker thread: apply new jobs and cancellations, then one iterate()."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        refused: list[tuple[AsyncJob, Exception]] = []
        for async_job in inbox:
            try:
                self.generator.enqueue(async_job.job)
            except (JobRejected, QueueFull) as error:
                refused.append((async_job, error))
                continue
            with self._lock:
                self._active[id(async_job.job)] = async_job
        for job in cancels:
            self.generator.cancel(job)
        results: list[Any] = self.generator.iterate() if self.generator.num_remaining_jobs() else []
        return refused, results
