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
