"""Errors as OpenAI's API returns them: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Handlers raise `APIError`; the app turns it (and a body that fails its model's validation, and anything else) into
that JSON, never a traceback. `validation_error` names the first offending field as `param` ("messages.0.role").
"""

from __future__ import annotations

import re

import pydantic

from posttrain.serve import protocol

__all__ = ["APIError", "error_body", "validation_error"]


class APIError(Exception):
    """An error answer: HTTP `status`, a one-line `message`, OpenAI's `type`, the `param` at fault, a `code`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(e: pydantic.ValidationError) -> APIError:
    """A 400 naming the first field that failed (its dotted path) and why."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if not _is_union_tag(p))
    why = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if not loc:  # a check across fields: its message starts with the field it is about
        head = re.match(r"[a-z_]+", why)
        loc = head.group(0) if head and head.group(0) in _model_fields(e) else ""
        if loc:
            return APIError(400, why, param=loc)
    if err.get("type") == "missing":
        return APIError(400, f"'{loc}' is a required field", param=loc or None, code="missing_required_parameter")
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"unknown field '{loc}'", param=loc or None)
    return APIError(400, f"'{loc}': {why}" if loc else why, param=loc or None)


def _is_union_tag(part) -> bool:
    """pydantic inserts the tried member's name in a union's location ("list[int]", "str"): not a field."""
    return isinstance(part, str) and (part[:1].islower() and ("[" in part or part in ("str", "int", "float", "bool"))
                                      or part.startswith(("function-", "tagged-union", "typed-dict")))


def _model_fields(e: pydantic.ValidationError) -> set[str]:
    """The field names of the model that failed (by its title), or none when it is not known here."""
    model = getattr(protocol, str(e.title), None)
    return set(getattr(model, "model_fields", {}))
