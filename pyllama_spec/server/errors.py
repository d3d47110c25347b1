"""The server's errors: answered as OpenAI-style ``{"error": {...}}`` bodies with a status."""

from __future__ import annotations


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "code", "param"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 code: str | None = None, param: str | None = None, headers: dict | None = None,
                 extra: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}
        self.extra = extra or {}  # more fields of the error object (llama-server's n_prompt_tokens, n_ctx, ...)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param,
                          **self.extra}}


def context_overflow(e, param: str) -> APIError:
    """A prompt that does not fit (a ContextOverflowError): a 400 with llama-server's error type and
    fields (its clients read them) and OpenAI's code."""
    extra = {k: v for k, v in (("n_prompt_tokens", e.n_prompt_tokens), ("n_ctx", e.n_ctx)) if v is not None}
    return APIError(400, str(e), type="exceed_context_size_error", code="context_length_exceeded", param=param,
                    extra=extra)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
