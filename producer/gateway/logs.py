"""Access-log hygiene. uvicorn's access log writes each request's path with its query string, and
a task's access token may travel as `?access_token=...` (a browser EventSource cannot send an
Authorization header): in the log it would outlive the task and reach whoever reads the logs.

Every query value is replaced by `[redacted]` in uvicorn's access log (names stay, so the log
still says which parameters were sent). The filter sits on the `uvicorn.access` logger itself,
which uvicorn's own logging setup leaves in place, so it holds however the app is served.
"""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"
REDACTED = "[redacted]"


def redact_query(target: str) -> str:
    """`/path?a=1&b` -> `/path?a=[redacted]&b`: the path with every query value hidden."""
    path, separator, query = target.partition("?")
    if not separator:
        return target
    pairs = []
    for pair in query.split("&"):
        name, equals, _ = pair.partition("=")
        pairs.append(f"{name}={REDACTED}" if equals else name)
    return f"{path}?{'&'.join(pairs)}"


class RedactQueryStrings(logging.Filter):
    """Rewrites the query strings among a log record's arguments (uvicorn passes the request
    target as one of them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(arg) if isinstance(arg, str) and "?" in arg else arg
                                for arg in record.args)
        return True


def redact_access_log() -> None:
    """Install the filter on uvicorn's access logger (once per process)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(existing, RedactQueryStrings) for existing in logger.filters):
        logger.addFilter(RedactQueryStrings())
