"""Strict reading of wire records: what every `from_wire` in cluster.protocol checks with.

A record's wire form is plain msgpack-able values (tuples, ints, floats, strings, bools, None, maps of
those); reading one back checks every field's type and a record's exact length, and a mismatch raises
ProtocolError naming the record and the field, so a peer speaking another protocol is a typed error at the
boundary, not an AttributeError three calls later. The links (cluster/framing.py) carry these values as
msgpack, never pickles; a record that crosses a Ray call carries its version in its wire form.
"""
from __future__ import annotations

from typing import Any

import msgpack

from cluster.errors import ProtocolError, ProtocolVersionError


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: bytes, what: str) -> Any:
    """msgpack bytes -> plain values (arrays as tuples); ProtocolError if they are not msgpack."""
    try:
        return msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.exceptions.UnpackException) as e:  # cut short, or not msgpack
        raise ProtocolError(f"{what} is not valid msgpack ({type(e).__name__}: {e})") from None


def record(raw: Any, name: str, fields: tuple[str, ...]) -> tuple:
    """`raw` as a positional record of exactly `fields` (a field sent and never read is a protocol bug)."""
    if type(raw) is not tuple and type(raw) is not list:
        raise ProtocolError(f"{name} must be an array of {len(fields)} fields {list(fields)}, "
                            f"got {type(raw).__name__}")
    if len(raw) != len(fields):
        raise ProtocolError(f"{name} must have {len(fields)} fields {list(fields)}, got {len(raw)}")
    return tuple(raw)


def versioned(raw: Any, name: str, version: int, fields: tuple[str, ...]) -> tuple:
    """A record that carries its version first (one crossing a Ray call): the version checked before the
    rest is read, so another version is a ProtocolVersionError, not a confusing field error."""
    if (type(raw) is tuple or type(raw) is list) and raw and raw[0] != version:
        raise ProtocolVersionError(f"{name} version {raw[0]!r}, this side speaks {version}: the deployments "
                                   f"run different Tandem versions")
    return record(raw, name, ("version",) + fields)[1:]


def check(ok: bool, name: str, field: str, expected: str, value: Any) -> None:
    if not ok:
        shown = repr(value) if len(repr(value)) <= 60 else f"a {type(value).__name__}"
        raise ProtocolError(f"{name} field {field!r} must be {expected}, got {shown}")


def integer(value: Any, name: str, field: str) -> int:
    check(type(value) is int, name, field, "an int", value)
    return value


def number(value: Any, name: str, field: str) -> float:
    check(type(value) is float or type(value) is int, name, field, "a number", value)
    return float(value)


def flag(value: Any, name: str, field: str) -> bool:
    check(type(value) is bool, name, field, "a bool", value)
    return value


def text(value: Any, name: str, field: str) -> str:
    check(type(value) is str, name, field, "a str", value)
    return value


def text_or_none(value: Any, name: str, field: str) -> str | None:
    check(value is None or type(value) is str, name, field, "a str or nil", value)
    return value


def array(value: Any, name: str, field: str) -> tuple:
    check(type(value) is tuple or type(value) is list, name, field, "an array", value)
    return tuple(value)


def ints(value: Any, name: str, field: str) -> tuple[int, ...]:
    value = array(value, name, field)
    check(all(type(v) is int for v in value), name, field, "an array of ints", value)
    return value


def texts(value: Any, name: str, field: str) -> tuple[str, ...]:
    value = array(value, name, field)
    check(all(type(v) is str for v in value), name, field, "an array of strs", value)
    return value


def hello(link: str, version: int) -> tuple:
    """What each end of a link sends once when it opens: the link's name and its protocol version."""
    return ("tandem", link, version)


def check_hello(raw: Any, link: str, version: int, peer: str) -> None:
    """The peer's hello: ProtocolVersionError if it speaks another version of `link`, ProtocolError if it
    is not a Tandem `link` at all."""
    if type(raw) is not tuple or len(raw) != 3 or raw[0] != "tandem" or raw[1] != link:
        raise ProtocolError(f"{peer} did not open the {link} link with a Tandem hello (got {raw!r:.80})")
    if raw[2] != version:
        raise ProtocolVersionError(f"{peer} speaks {link} link protocol version {raw[2]!r}, this side "
                                   f"speaks {version}: they run different Tandem versions")
