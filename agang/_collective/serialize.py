"""How the object collectives turn objects into bytes and back: ``"safe"`` or ``"pickle"``.

Rules:
1. *Safe runs no code on receipt.* The ``"safe"`` format is a small tagged encoding of
   plain data (None, bool, int, float, str, bytes, list, tuple, dict), read by a parser
   that only builds those types: no class is looked up and no method of the payload is
   called, whatever the bytes say. Only exact instances are encoded (a subclass such as
   an ``IntEnum`` or a ``namedtuple`` could not come back as itself), and nesting stops
   at ``MAX_DEPTH``.
2. *Pickle is trusted.* ``"pickle"`` encodes anything picklable; unpickling can run any
   code its sender chose, so it is only ever chosen by name.
3. *The payload says its format.* Its first byte names the format it was written in. A
   rank that asked for ``"safe"`` refuses a pickled payload (it never unpickles); a rank
   that asked for ``"pickle"`` reads both.
4. *Refusals are ``TypeError`` (an object the format cannot write) or ``ValueError`` (a
   payload it cannot read).*
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

from agang._gang import Serializer

#: How deep lists, tuples and dicts may nest in the safe format.
MAX_DEPTH = 100

_SAFE = 0x53  # "S": the first byte of a payload in the safe format
_PICKLE = 0x50  # "P": the first byte of a pickled payload

# The safe format's tags, one byte before each value; lengths and counts are unsigned
# 64-bit little-endian, ints in 64 bits are signed, floats are IEEE 754 doubles. A list
# or tuple of 64-bit ints (or of floats) is written as one packed array: Python code per
# item is what makes this format slower than pickle, so the common bulk case skips it.
_NONE, _TRUE, _FALSE = 0x4E, 0x54, 0x46  # N T F
_INT, _BIG_INT, _FLOAT = 0x69, 0x49, 0x66  # i I f
_STR, _BYTES = 0x73, 0x62  # s b
_LIST, _TUPLE, _DICT = 0x6C, 0x74, 0x64  # l t d
_INTS, _INT_TUPLE, _FLOATS, _FLOAT_TUPLE = 0x78, 0x58, 0x79, 0x59  # x X y Y
_PACKED = {_INTS: "q", _INT_TUPLE: "q", _FLOATS: "d", _FLOAT_TUPLE: "d"}
#: The fewest items worth packing.
_PACK_FROM = 8

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_TAG_U64 = struct.Struct("<BQ")
_TAG_I64 = struct.Struct("<Bq")
_TAG_F64 = struct.Struct("<Bd")
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def check_serializer(serializer: object) -> Serializer:
    if serializer == "safe" or serializer == "pickle":
        return serializer
    raise ValueError(f"`serializer` must be 'safe' or 'pickle', but is {serializer!r} instead.")


def encode(obj: Any, serializer: Serializer, *, name: str) -> list[bytes]:
    """``obj`` as the parts of one payload (joined by the caller), its format's byte first.

    Raises:
        TypeError: ``obj`` cannot be written in ``serializer``'s format.
    """
    if serializer == "pickle":
        try:
            return [bytes((_PICKLE,)), pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)]
        except Exception as exc:
            raise TypeError(
                f"`{name}` must be picklable, but pickling it failed instead: {exc}"
            ) from exc
    parts = [bytes((_SAFE,))]
    try:
        _write(obj, parts, 0)
    except _Unsupported as exc:
        raise TypeError(
            f"`{name}` must hold only None, bool, int, float, str, bytes, list, tuple and "
            f"dict for serializer='safe', but holds {exc} instead; pass "
            f"serializer='pickle' on every rank to send any picklable object (only "
            f"between ranks that trust each other: unpickling can run code)."
        ) from None
    return parts


def decode(data: memoryview, serializer: Serializer, *, sender: str) -> Any:
    """The object in the payload ``data`` (rule 3); ``sender`` names it for errors.

    Raises:
        ValueError: ``data`` is not a payload this rank may read.
    """
    if not data:
        raise ValueError(f"The payload from {sender} is empty.")
    kind = data[0]
    body = data[1:]
    if kind == _PICKLE:
        if serializer != "pickle":
            raise ValueError(
                f"{sender} sent pickled objects, but this rank passed serializer='safe', "
                f"which never unpickles; pass the same `serializer` on every rank."
            )
        return pickle.loads(body)
    if kind != _SAFE:
        raise ValueError(f"The payload from {sender} is in no known format (byte {kind}).")
    try:
        value, end = _read(body, 0, 0)
    except (IndexError, struct.error, UnicodeDecodeError, TypeError, RecursionError) as exc:
        raise ValueError(f"The payload from {sender} is malformed: {exc!r}.") from None
    if end != len(body):
        raise ValueError(f"The payload from {sender} has {len(body) - end} bytes past its end.")
    return value


class _Unsupported(Exception):
    """A value the safe format does not write (its message says which)."""


def _write(obj: Any, parts: list[bytes], depth: int) -> None:
    kind = type(obj)
    if kind is str:
        raw = obj.encode("utf-8", "surrogatepass")
        parts += (_TAG_U64.pack(_STR, len(raw)), raw)
    elif kind is int:
        if _I64_MIN <= obj <= _I64_MAX:
            parts.append(_TAG_I64.pack(_INT, obj))
        else:
            raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
            parts += (_TAG_U64.pack(_BIG_INT, len(raw)), raw)
    elif kind is float:
        parts.append(_TAG_F64.pack(_FLOAT, obj))
    elif obj is None:
        parts.append(b"N")
    elif kind is bool:
        parts.append(b"T" if obj else b"F")
    elif kind is bytes:
        parts += (_TAG_U64.pack(_BYTES, len(obj)), obj)
    elif kind is list or kind is tuple or kind is dict:
        if depth >= MAX_DEPTH:
            raise _Unsupported(f"containers nested deeper than {MAX_DEPTH} (a cycle?)")
        if kind is dict:
            parts.append(_TAG_U64.pack(_DICT, len(obj)))
            for key, value in obj.items():
                _write(key, parts, depth + 1)
                _write(value, parts, depth + 1)
        elif not _write_packed(obj, parts):
            parts.append(_TAG_U64.pack(_LIST if kind is list else _TUPLE, len(obj)))
            for item in obj:
                _write(item, parts, depth + 1)
    else:
        raise _Unsupported(f"an object of type `{kind.__module__}.{kind.__qualname__}`")


def _write_packed(items: list[Any] | tuple[Any, ...], parts: list[bytes]) -> bool:
    """Writes ``items`` as one packed array if they are all 64-bit ints or all floats."""
    if len(items) < _PACK_FROM:
        return False
    first = type(items[0])
    if (first is not int and first is not float) or not all(type(v) is first for v in items):
        return False
    is_list = type(items) is list
    if first is int:
        tag, code = (_INTS if is_list else _INT_TUPLE), "q"
    else:
        tag, code = (_FLOATS if is_list else _FLOAT_TUPLE), "d"
    try:
        packed = struct.pack(f"<{len(items)}{code}", *items)
    except struct.error:  # an int past 64 bits
        return False
    parts += (_TAG_U64.pack(tag, len(items)), packed)
    return True


def _read(data: memoryview, at: int, depth: int) -> tuple[Any, int]:
    """The value that starts at ``at`` in ``data``, and where the next one starts."""
    tag = data[at]
    at += 1
    if tag == _INT:
        return _I64.unpack_from(data, at)[0], at + 8
    if tag == _FLOAT:
        return _F64.unpack_from(data, at)[0], at + 8
    if tag == _NONE:
        return None, at
    if tag == _TRUE:
        return True, at
    if tag == _FALSE:
        return False, at
    (length,) = _U64.unpack_from(data, at)
    at += 8
    if tag in (_STR, _BYTES, _BIG_INT):
        end = at + length
        if end > len(data):
            raise IndexError(f"a value of {length} bytes runs past the end")
        if tag == _STR:
            return str(data[at:end], "utf-8", "surrogatepass"), end
        if tag == _BYTES:
            return data[at:end].tobytes(), end
        return int.from_bytes(data[at:end], "little", signed=True), end
    code = _PACKED.get(tag)
    if code is not None:
        end = at + 8 * length
        if end > len(data):
            raise IndexError(f"{length} packed items run past the end")
        values = struct.unpack_from(f"<{length}{code}", data, at)
        return (list(values) if tag in (_INTS, _FLOATS) else values), end
    if tag != _LIST and tag != _TUPLE and tag != _DICT:
        raise TypeError(f"unknown tag {tag}")
    if depth >= MAX_DEPTH:
        raise TypeError(f"containers nested deeper than {MAX_DEPTH}")
    if length > len(data) - at:  # every item takes at least one byte: a bound on bogus counts
        raise IndexError(f"{length} items cannot fit in the bytes left")
    if tag == _DICT:
        result: dict[Any, Any] = {}
        for _ in range(length):
            key, at = _read(data, at, depth + 1)
            result[key], at = _read(data, at, depth + 1)  # an unhashable key: TypeError
        return result, at
    items = []
    for _ in range(length):
        item, at = _read(data, at, depth + 1)
        items.append(item)
    return (items if tag == _LIST else tuple(items)), at
