"""`genq worker` whose engine serves LoRA adapters registered once it is up, for the routing tests
of issue 28 until the worker has its own option for them:

    python -m tests.adapter_worker NAME=PATH[,NAME=PATH...] <genq's arguments>

On Celery's worker_ready (the engine loaded, no task taken yet) each adapter is registered on
the engine's registry and the worker's card is published again, now listing them."""

from __future__ import annotations

import sys
from typing import Any

from celery.signals import worker_ready

from worker import runtime
from worker.cli import main
from worker.model_card import describe

READY_TIMEOUT_S = 120.0


def register_on_ready(adapters: dict[str, str]) -> None:
    def register(**_: Any) -> None:
        engine = runtime.current(READY_TIMEOUT_S)
        for name, path in adapters.items():
            engine.generator.adapters.register(name, path)
        engine.card.card = describe(engine.generator, engine.settings.model)[0]
        engine.card.heartbeat()

    worker_ready.connect(register, weak=False)


if __name__ == "__main__":
    register_on_ready(dict(pair.split("=", 1) for pair in sys.argv[1].split(",")))
    sys.exit(main(sys.argv[2:]))
