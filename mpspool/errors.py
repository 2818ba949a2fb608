"""Status codes and the one error type a request can fail with, on either side of the wire.

Codes are gRPC's (and TensorFlow's tensorflow.error.Code, which uses the same numbers), so
a worker's error crosses ZeroMQ as an integer and reaches the client unchanged.
"""

from __future__ import annotations

import enum
import errno


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


def code_of(value: int) -> Code:
    """The code numbered ``value`` (as TensorFlow's OpError.error_code); UNKNOWN for a number
    outside gRPC's range."""
    return Code(value) if value in Code._value2member_map_ else Code.UNKNOWN


def status_text(code: Code | int, message: str) -> str:
    """A failure's reason in absl::Status::ToString's form ("NOT_FOUND: message"): how the
    code of a version's load failure travels with its words (a process's fatal line, the
    controller's version tables, `mpspool status`) to the front door, which answers
    GetModelStatus with both, as TF Serving does (router/src/status.rs, split_status_text).
    UNKNOWN is left unsaid: a reason without a code is UNKNOWN."""
    code = Code(code)
    return message if code in (Code.OK, Code.UNKNOWN) else f"{code.name}: {message}"


def split_status_text(text: str) -> tuple[Code, str]:
    """`status_text` read back (the front door's split_status_text, router/src/status.rs): a
    text that does not begin with a code's name is UNKNOWN, all of it the message."""
    name, sep, message = text.partition(": ")
    if sep and name in Code.__members__ and name != Code.OK.name:
        return Code[name], message
    return Code.UNKNOWN, text


def in_context(context: str, text: str) -> str:
    """A status text with ``context`` put before its message, its code kept first: put
    before the code, it hid it, and the front door read UNKNOWN (found by a hunt)."""
    code, message = split_status_text(text)
    return status_text(code, f"{context}{message}")


# TensorFlow's reading of an errno (tsl/platform/errors.cc, ErrnoToCode), for those a load meets.
_CODE_OF_ERRNO = {
    errno.ENOENT: Code.NOT_FOUND,
    errno.ENXIO: Code.NOT_FOUND,
    errno.ENODEV: Code.NOT_FOUND,
    errno.EACCES: Code.PERMISSION_DENIED,
    errno.EPERM: Code.PERMISSION_DENIED,
    errno.EROFS: Code.PERMISSION_DENIED,
    errno.ENOTDIR: Code.FAILED_PRECONDITION,
    errno.EISDIR: Code.FAILED_PRECONDITION,
    errno.ENAMETOOLONG: Code.INVALID_ARGUMENT,
    errno.ENOSPC: Code.RESOURCE_EXHAUSTED,
    errno.ENOMEM: Code.RESOURCE_EXHAUSTED,
    errno.EMFILE: Code.RESOURCE_EXHAUSTED,
    errno.ENFILE: Code.RESOURCE_EXHAUSTED,
    errno.EFBIG: Code.RESOURCE_EXHAUSTED,
    errno.EIO: Code.UNAVAILABLE,
}


# The same for an OSError raised without an errno, by its class (TensorFlow's loader raises
# FileNotFoundError("Unsuccessful TensorSliceReader constructor: ...") so).
_CODE_OF_CLASS = (
    (FileNotFoundError, Code.NOT_FOUND),
    (PermissionError, Code.PERMISSION_DENIED),
    (NotADirectoryError, Code.FAILED_PRECONDITION),
    (IsADirectoryError, Code.FAILED_PRECONDITION),
)


def code_of_os_error(exc: OSError) -> Code:
    """The code TensorFlow gives a failed file operation with ``exc``'s errno, or its class
    when it has none (UNKNOWN when neither says)."""
    if exc.errno:
        return _CODE_OF_ERRNO.get(exc.errno, Code.UNKNOWN)
    return next((code for kind, code in _CODE_OF_CLASS if isinstance(exc, kind)), Code.UNKNOWN)
