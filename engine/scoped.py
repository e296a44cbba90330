"""A value set around one forward and read by the layers inside it (attention metadata, ADP's padded row
count): a context variable, so threads and tasks each see their own, and never a module global a
concurrent forward could overwrite. A captured CUDA graph bakes in what it read at capture."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class ForwardScoped(Generic[T]):
    def __init__(self, name: str, missing: str):
        """missing: the error when a layer reads the value outside any `scope`."""
        self._var: contextvars.ContextVar[T | None] = contextvars.ContextVar(name, default=None)
        self._missing = missing

    @contextlib.contextmanager
    def scope(self, value: T) -> Iterator[T]:
        token = self._var.set(value)
        try:
            yield value
        finally:
            self._var.reset(token)

    def get(self) -> T:
        value = self._var.get()
        if value is None:
            raise RuntimeError(self._missing)
        return value
