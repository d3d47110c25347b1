"""The server's errors: answered as OpenAI-style ``{"error": {...}}`` bodies with a status."""

from __future__ import annotations


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "code", "param"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 code: str | None = None, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
