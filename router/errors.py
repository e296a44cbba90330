"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with the right HTTP status."""
from __future__ import annotations

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import TandemError


class APIError(Exception):
    """An error the router answers with directly."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param, self.code = status, message, error_type, param, code

    @staticmethod
    def from_tandem(e: TandemError) -> "APIError":
        return APIError(e.http_status, e.message, e.error_type, e.param, None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _path(loc) -> list[str]:
    """A pydantic error location as the request's field path: without FastAPI's leading "body" and without
    the tags pydantic adds for each member of a union (`str`, `list[int]`, `ChatContentPart`, ...)."""
    return [str(p) for p in loc if p != "body" and not (isinstance(p, str) and (
        p in _TYPE_TAGS or "[" in p or "-" in p or p[:1].isupper()))]


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = _path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return invalid(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
                       ).response()
    if not loc and first.get("type") in ("dict_type", "model_attributes_type", "missing"):
        return invalid("the request body must be a JSON object (Content-Type: application/json)").response()
    param = ".".join(loc) or None
    message = "; ".join(f"{'.'.join(_path(e.get('loc', ()))) or 'body'}: {e.get('msg')}" for e in errors[:5])
    return invalid(message, param).response()


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    if exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI's own words
        return invalid("the request body cannot be parsed: not JSON, or JSON nested too deep").response()
    return APIError(exc.status_code, str(exc.detail), kind, None, getattr(exc, "error_code", None)).response()


def install(app) -> None:
    app.add_exception_handler(APIError, lambda request, exc: exc.response())
    app.add_exception_handler(TandemError, lambda request, exc: APIError.from_tandem(exc).response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
