"""Server logs never carry a bearer token.

EventSource clients cannot send headers, so ``GET /v1/jobs/{id}/events`` also takes
``?token=``. Uvicorn's access log writes the request line, query string included; this filter
blanks the value of every ``token`` query parameter before the record is written.
"""

from __future__ import annotations

import logging
import re

_TOKEN = re.compile(r"([?&]token=)[^&\s\"]*", re.IGNORECASE)


def redact(text: str) -> str:
    return _TOKEN.sub(r"\1<redacted>", text)


class RedactTokens(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True


def redact_tokens() -> None:
    """Install the filter on uvicorn's access and error loggers (and ours)."""
    for name in ("uvicorn.access", "uvicorn.error", "hpservice.api"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(RedactTokens())
