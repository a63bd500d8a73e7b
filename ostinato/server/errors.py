"""Errors in the shape of the API that was called.

OpenAI's routes answer {"error": {"message", "type", "param", "code"}}; Anthropic's
(/v1/messages...) answer {"type": "error", "error": {"type", "message"}}. Clients (the
`openai` and `anthropic` packages, agent frameworks) read the message and show it, so
every failure, ours or the caller's, leaves the server as one of these with a status
that says whose fault it was; nothing a request sends can take the server down. One
exception type serves both: the handler picks the shape from the request's path.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "unavailable_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response(is_anthropic(request.url.path))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        return APIError(e.status_code, str(e.detail)).response(is_anthropic(request.url.path))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        error = APIError(500, f"internal error: {type(e).__name__}: {e}")
        return error.response(is_anthropic(request.url.path))
