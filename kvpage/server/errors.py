"""Errors of the server, every one in OpenAI's body: {"error": {"message", "type", "param", "code"}}.

`APIError` is what handlers raise; `install_error_handlers` makes FastAPI's own errors (404 for an
unknown path, 405, validation errors, malformed JSON) and anything unexpected (500) use the same
body, so a client never has to parse plain text.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvpage.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          503: "service_unavailable"}  # fmt: skip


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type_: str | None = None, param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            msg, param = f"the request body is not valid JSON: {err.get('ctx', {}).get('error', msg)}", None
        else:
            param = ".".join(loc) or (msg.split(":", 1)[0] if ": " in msg else None)
            msg = f"{param}: {msg}" if param and not msg.startswith(f"{param}:") else msg
        return error_response(APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            msg = f"no such endpoint: {request.method} {request.url.path}"
        elif e.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(e.detail)
        return error_response(APIError(e.status_code, msg), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, e: Exception):
        log.exception("unexpected error in a request")
        return error_response(APIError(500, f"internal server error: {type(e).__name__}: {e}"))
