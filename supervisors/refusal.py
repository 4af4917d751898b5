"""A request refused with a teaching error, as the supervisors raise it and every dialect renders it.

`Refusal` carries the HTTP status, the message, the fix, and where they apply an error code and a Retry-After.
It knows nothing of Quart: a route renders it in its dialect's error shape with `dialects.edge.refuse` (or
`respond` for a given path); on the wire the fix is the message's "(fix: …)" and the body's `hint` field.
"""

from __future__ import annotations

import math

from blazar.errors import TeachingError, error_bytes

from .actor import Err


class Refusal(TeachingError):
    def __init__(self, status: int, message: str, *, code: str | None = None, fix: str = "",
                 retry_after: float = 0.0, param: str | None = None) -> None:
        super().__init__(message, fix, status)
        self.code = code
        self.retry_after = retry_after
        self.param = param  # the request field at fault (OpenAI's error `param`), when one is

    @classmethod
    def from_err(cls, err: Err) -> Refusal:
        return cls(err.status, err.message, code=err.code, fix=err.fix, retry_after=err.retry_after)

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(math.ceil(self.retry_after))} if self.retry_after else {}

    def body(self, path: str) -> bytes:
        """The error body in the dialect of `path` (blazar.errors.error_bytes)."""
        message = f"{self.message} (fix: {self.fix})" if self.fix else self.message
        extra: dict[str, str] = {"hint": self.fix} if self.fix else {}
        if self.param:
            extra["param"] = self.param
        return error_bytes(path, self.status, message, **extra)
