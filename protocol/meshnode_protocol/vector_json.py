"""The JSON form of messages in the golden vectors (``protocol/vectors/``), both ways:
:func:`to_json` and its inverse :func:`from_json`. Tensors appear as ``{"dtype", "shape",
"data_hex"}``; tuples as arrays; nested records as objects. Shared by the canonical
vectors (:mod:`meshnode_protocol.vectors`) and the lenient ones
(:mod:`meshnode_protocol.edge_vectors`).
"""

from __future__ import annotations

from typing import Any

from meshnode_protocol._fields import (
    Kind,
    _Optional,
    _Pair,
    _Record,
    _Tensor,
    _Tuple,
    _Union,
    compile_fields,
)
from meshnode_protocol._messages import MESSAGE_TYPES, Message
from meshnode_protocol._tensor import Tensor


def to_json(value: Any) -> Any:
    """A message, record or field value in the vectors' JSON form."""
    if isinstance(value, Tensor):
        return {
            "dtype": value.dtype,
            "shape": list(value.shape),
            "data_hex": bytes(value.data).hex(),
        }
    if isinstance(value, tuple):
        return [to_json(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: to_json(getattr(value, f.name)) for f in compile_fields(type(value))}
    return value


def from_json(cls: type[Message], fields: dict[str, Any]) -> Message:
    """The message of type ``cls`` whose JSON form is ``fields`` (inverse of ``to_json``)."""
    return _record_from_json(cls, fields)  # type: ignore[no-any-return]


def _record_from_json(cls: type, fields: dict[str, Any]) -> Any:
    kwargs = {f.name: _value_from_json(f.kind, fields[f.name]) for f in compile_fields(cls)}
    return cls(**kwargs)


def _value_from_json(kind: Kind, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(kind, _Optional):
        return _value_from_json(kind.inner, value)
    if isinstance(kind, _Union):
        tensor = isinstance(value, dict)
        option = next(o for o in kind.options if isinstance(o, _Tensor) == tensor)
        return _value_from_json(option, value)
    if isinstance(kind, _Tensor):
        return Tensor(value["dtype"], tuple(value["shape"]), bytes.fromhex(value["data_hex"]))
    if isinstance(kind, _Record):
        return _record_from_json(kind.cls, value)
    if isinstance(kind, _Tuple):
        return tuple(_value_from_json(kind.item, v) for v in value)
    if isinstance(kind, _Pair):
        return tuple(value)
    return value


def message_class(name: str) -> type[Message]:
    """The message class called ``name``."""
    return next(cls for cls in MESSAGE_TYPES.values() if cls.__name__ == name)
