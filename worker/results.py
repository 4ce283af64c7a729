"""Celery's Redis result backend with fewer commands per stored state (issue 30).

Celery stores every state of a task (STARTED, then SUCCESS or FAILURE) as a GET of the state
stored so far (a SUCCESS is never overwritten), then SETEX and PUBLISH inside MULTI/EXEC: five
commands and two round trips, ten a genq request; here five. The same keys, values and channel, so every
reader (AsyncResult, the gateway, Flower, producer/watchdog.py) sees what it saw before:

* SET (with its expiry) and PUBLISH go out as a plain pipeline: MULTI/EXEC made them atomic,
  which no reader needs (a reader woken by the PUBLISH finds the value, the SET having run first
  on the same connection).
* genq.generate's STARTED skips the read: it is stored only by worker/delivery.py's decide(),
  right after it read the same key and found no final state there (genq.generate turns Celery's
  own track_started off for that), so the read would ask Redis the same question twice.
"""

from __future__ import annotations

from typing import Any

from celery import states
from celery.backends.base import BackendStoreError
from celery.backends.redis import RedisBackend
from kombu.utils.encoding import bytes_to_str

from producer.protocol import TASK_NAME

RESULT_BACKEND = "worker.results:ResultBackend"
"""The class part of the worker's result backend URL for a redis:// or rediss:// backend (worker/app.py)."""


class ResultBackend(RedisBackend):
    def _set(self, key: str, value: str, expires: int | None = None) -> None:
        if expires is None:
            expires = self.expires
        with self.client.pipeline(transaction=False) as pipe:
            pipe.set(key, value, ex=expires or None)
            pipe.publish(key, value)
            pipe.execute()

    def _store_result(self, task_id: str, result: Any, state: str, traceback: str | None = None,
                      request: Any = None, **kwargs: Any) -> Any:
        if state != states.STARTED or getattr(request, "task", None) != TASK_NAME:
            return super()._store_result(task_id, result, state, traceback, request, **kwargs)
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        try:
            self._set_with_state(self.get_key_for_task(task_id), self.encode(meta), state)
        except BackendStoreError as error:
            raise BackendStoreError(str(error), state=state, task_id=task_id) from error
        return result
