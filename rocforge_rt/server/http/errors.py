"""Errors in OpenAI's shape, and the one table from the daemon's error codes to HTTP statuses.

Every refusal the front sends is `{"error": {"message", "type", "param", "code"}}` with
the status a client of the OpenAI API expects for it (its SDK raises the matching
exception: BadRequestError for 400, NotFoundError for 404, RateLimitError for 429...).
"""

from typing import Any

from rocforge_rt.server.fields import ErrorCode

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
RATE_LIMIT = "rate_limit_error"
UNAVAILABLE = "service_unavailable"
CONTEXT_LENGTH = "context_length_exceeded"


class ApiError(Exception):
    """A request that gets an error response."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_field(param: str | None, message: str) -> ApiError:
    """A 400 naming the field that is wrong."""
    return ApiError(400, message, param=param)


# the daemon's code -> (HTTP status, error type); a code missing here is a front bug: 500
DAEMON_ERRORS: dict[str, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, INVALID_REQUEST),
    ErrorCode.CONTEXT_FULL: (400, INVALID_REQUEST),
    ErrorCode.LIMIT_EXCEEDED: (400, INVALID_REQUEST),
    ErrorCode.TOO_LARGE: (413, INVALID_REQUEST),
    ErrorCode.BUSY: (429, RATE_LIMIT),
    ErrorCode.RATE_LIMITED: (429, RATE_LIMIT),
    ErrorCode.NOT_READY: (503, UNAVAILABLE),
    ErrorCode.SHUTTING_DOWN: (503, UNAVAILABLE),
    ErrorCode.ABORTED: (503, UNAVAILABLE),  # the front aborts only for a client gone: shutdown
    ErrorCode.DEADLINE_EXCEEDED: (504, SERVER_ERROR),
    ErrorCode.INTERNAL: (500, SERVER_ERROR),
}


def from_daemon(code: str, message: str, prompt_field: str | None = None) -> ApiError:
    """The response to a daemon's error reply to a generation whose prompt is `prompt_field`."""
    status, kind = DAEMON_ERRORS.get(code, (500, SERVER_ERROR))
    if code in (ErrorCode.CONTEXT_FULL, ErrorCode.LIMIT_EXCEEDED):
        return ApiError(
            status, f"the prompt is too long: {message}", kind, prompt_field, CONTEXT_LENGTH
        )
    if code == ErrorCode.BUSY:
        message = f"the daemon is busy: {message}"
    elif status == 500:
        message = f"the daemon failed on this request ({code}): {message}"
    return ApiError(status, message, kind, None, code)


def unavailable(message: str) -> ApiError:
    """The daemon cannot be reached, or is not serving: 503."""
    return ApiError(503, message, UNAVAILABLE, None, "daemon_unavailable")
