"""Status codes and the one error type a request can fail with, on either side of the wire.

Codes are gRPC's (and TensorFlow's tensorflow.error.Code, which uses the same numbers), so
a worker's error crosses ZeroMQ as an integer and reaches the client unchanged.
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class ServingError(Exception):
    """A request failed with a TF Serving status code and message."""

    def __init__(self, code: Code | int, message: str) -> None:
        super().__init__(message)
        self.code = Code(code)
        self.message = message

    def __repr__(self) -> str:
        return f"ServingError({self.code.name}, {self.message!r})"
