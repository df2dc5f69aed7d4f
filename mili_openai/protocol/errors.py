"""OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status it goes
out with; the server's handlers (server/errors.py) turn every failure into one."""

from __future__ import annotations

from typing import Any

import pydantic

INVALID_REQUEST = "invalid_request_error"
INTERNAL_ERROR = "internal_error"
# OpenAI's error `type` for the statuses that are not plain bad input
TYPE_BY_STATUS = {
    401: "authentication_error",
    404: INVALID_REQUEST,
    413: INVALID_REQUEST,
    429: "rate_limit_exceeded",
    500: INTERNAL_ERROR,
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the client should see as-is, with its HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = INVALID_REQUEST,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # sent with the response (e.g. Retry-After of a 429)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(exc: pydantic.ValidationError) -> APIError:
    """The first problem pydantic found, with `param` the dotted path of the field it concerns."""
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in _field_path(first.get("loc", ()))) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "value_error":  # our own validators: drop pydantic's "Value error, " prefix
        message = str(first.get("ctx", {}).get("error", message))
    return APIError(400, f"{param}: {message}" if param else message, param=param)


# pydantic puts the union member it tried into `loc` ("prompt", "str"); those are not fields
UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "model", "literal"})


def _field_path(loc: tuple) -> list:
    """The field path of a pydantic error location, stopping at the first union-member tag."""
    path = []
    for part in loc:
        if isinstance(part, str) and (part.lower() in UNION_TAGS or "[" in part or "(" in part):
            break
        path.append(part)
    return path
