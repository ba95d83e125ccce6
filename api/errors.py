"""JSON errors everywhere: {"error": {"code", "message", "details"}}; bad input is never a 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("hpservice.api")

_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
          408: "timeout", 409: "conflict", 413: "too_large", 415: "unsupported_media_type", 422: "invalid",
          429: "too_many", 503: "unavailable"}  # fmt: skip


class APIError(Exception):
    def __init__(self, status: int, message: str, details: list | None = None, code: str | None = None):
        self.status, self.message, self.details = status, message, details or []
        self.code = code or _CODES.get(status, "error")


def error_body(status: int, message: str, details: list | None = None, code: str | None = None) -> dict:
    return {"error": {"code": code or _CODES.get(status, "error"), "message": message, "details": details or []}}


def store_failure(exc: Exception) -> str:
    """The database's own one-line reason ("database or disk is full"), without the SQL."""
    orig = getattr(exc, "orig", None) or exc
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0][:200]


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.status, exc.message, exc.details, exc.code), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        details = [
            {"path": ".".join(str(p) for p in e["loc"] if p != "body"), "message": e["msg"]} for e in exc.errors()
        ]
        return JSONResponse(error_body(422, "invalid request", details), status_code=422)

    @app.exception_handler(OperationalError)
    async def _store_unavailable(request: Request, exc: OperationalError):
        # disk full, read-only data dir, database gone: the request loses nothing and may be retried
        reason = store_failure(exc)
        log.error("store unavailable on %s %s: %s", request.method, request.url.path, reason)
        return JSONResponse(error_body(503, f"store unavailable: {reason}"), status_code=503, headers={"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, "internal error (logged on the server)"), status_code=500)
