"""The worker's own threads under their names in the kernel too (Python names them only for
itself): `top -H`, /proc/<pid>/task/*/comm and the tests that read a thread's scheduler figures
(tests/test_big_requests_service.py) tell the engine loop apart from the rest."""

from __future__ import annotations

import threading
from pathlib import Path

KERNEL_NAME_CHARS = 15


def name_this_thread() -> None:
    """Give the calling thread its Python name (cut to the kernel's 15 characters) in the kernel;
    where there is no /proc (not Linux), nothing."""
    try:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(
            threading.current_thread().name[:KERNEL_NAME_CHARS])
    except OSError:
        pass
