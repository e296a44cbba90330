"""Errors of the distributed layer; each carries a message a user or operator can act on."""
from engine.errors import TandemError


class ChannelError(TandemError):
    """A hand-over channel could not be built, timed out, or its peer went away."""

    http_status = 503
    error_type = "unavailable_error"


class WorkerDiedError(TandemError):
    """A rank actor or worker process died while serving the request."""

    http_status = 503
    error_type = "unavailable_error"


class ProtocolError(TandemError):
    """A record that crossed a process boundary is not what this side's protocol expects: a missing or
    mistyped field, a wrong length, bytes that are not a record at all. The message names the field."""

    http_status = 503
    error_type = "unavailable_error"


class ProtocolVersionError(ProtocolError):
    """The two ends of a link (or a caller and a deployment) speak different protocol versions: they run
    different Tandem versions. Found when a link opens, before any request crosses it."""


class HandoverHeaderError(ProtocolError):
    """A hand-over header is not what this decode rank's protocol expects (version, fields, bytes)."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id  # when the header says which request it was for
