"""Errors of the parameter server, each naming the gRPC status it travels as.

The shard store and the wire codec raise these; the servicer turns them into
`context.abort(StatusCode[err.status], str(err))` and counts `err.reason`,
so the store stays free of gRPC and every rejection is counted by cause.
"""

from __future__ import annotations


class PSError(Exception):
    status = "INTERNAL"

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


class InvalidArgument(PSError):
    status = "INVALID_ARGUMENT"


class FailedPrecondition(PSError):
    status = "FAILED_PRECONDITION"


class AlreadyExists(PSError):
    status = "ALREADY_EXISTS"


class DataLoss(PSError):
    status = "DATA_LOSS"


class Unavailable(PSError):
    status = "UNAVAILABLE"


class DeadlineExceeded(PSError):
    status = "DEADLINE_EXCEEDED"
