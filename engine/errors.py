"""Typed errors. Each carries a message a user can act on; the HTTP layer maps them to 4xx/5xx."""


class TandemError(Exception):
    """Base of every error Tandem raises on purpose."""

    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(TandemError, ValueError):
    """The request itself is wrong (bad parameter, prompt too long): HTTP 400."""

    http_status = 400
    error_type = "invalid_request_error"


class ModelLoadError(TandemError):
    """A checkpoint cannot be loaded: missing or misshapen weights, unreadable files."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture or one of its features is not implemented."""


class CapacityError(TandemError):
    """The engine cannot take more work right now (queue bound): HTTP 503."""

    http_status = 503
    error_type = "overloaded_error"
