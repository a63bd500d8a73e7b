"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Clients (the `openai` package, agent frameworks) read `error.message` and show it, so
every failure, ours or the caller's, leaves the server as one of these with a status
that says whose fault it was; nothing a request sends can take the server down.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 500: "server_error", 503: "unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}").response()
