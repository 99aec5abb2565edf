"""Field kinds: validation and wire conversion compiled once from a record's type hints.

Every message and record is a frozen dataclass whose annotations use only these forms::

    str  int  UInt  float  bool  bytes  Tensor  <Record>  tuple[X, ...]  tuple[int, int]
    X | None
    Tensor | tuple[float, ...] | None                          (a union of the above)

``compile_fields(cls)`` turns each annotation into a ``Kind`` with three operations:
``check`` (constructor values, raises ``TypeError``), ``encode`` (value -> CBOR-ready
object; tensors are appended to a list and replaced by their descriptor) and ``decode``
(CBOR object -> value; raises ``WireError``). Doing this once per class keeps the per-frame
cost of an ``ActivationFrame`` to a dict build and a few ``isinstance`` checks.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Final

from meshnode_protocol._tensor import DTYPE_SIZES, MAX_TENSOR_DIMS, Tensor

# CBOR can carry integers in [-2**64, 2**64 - 1] (major types 0 and 1), but no common
# language has that type, so every integer field is one of two 64-bit types that every
# implementation has natively (protocol/README.md §3): ``int`` is signed (i64), ``UInt``
# unsigned (u64). Anything wider would need a bignum tag, which this protocol does not use.
INT_MIN: Final = -(2**63)
INT_MAX: Final = 2**63 - 1
UINT_MAX: Final = 2**64 - 1


class _Unsigned:
    """Marker in ``Annotated[int, ...]`` for an unsigned 64-bit field."""

    def __repr__(self) -> str:
        return "unsigned"


UInt = Annotated[int, _Unsigned()]
"""An unsigned 64-bit integer field (``0 <= value <= 2**64 - 1``); a plain ``int`` to mypy."""

_MISSING: Final = dataclasses.MISSING


class WireError(ValueError):
    """A header value does not fit its field; the codec turns it into RemoteProtocolError."""


class Payload:
    """Cursor over a frame's raw payload: tensors are cut from it in field order."""

    __slots__ = ("offset", "view")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.offset = 0

    def take(self, nbytes: int) -> memoryview:
        end = self.offset + nbytes
        if end > len(self.view):
            raise WireError("tensor descriptors claim more bytes than the payload holds")
        chunk = self.view[self.offset : end]
        self.offset = end
        return chunk


class Kind:
    """How one annotated type is checked, encoded and decoded."""

    name = "?"
    identity = False  # encode/decode are the identity (plain CBOR scalars)

    def check(self, value: Any) -> Any:
        raise NotImplementedError

    def encode(self, value: Any, tensors: list[Tensor]) -> Any:
        return value

    def decode(self, wire: Any, payload: Payload) -> Any:
        try:
            return self.check(wire)
        except (TypeError, ValueError) as exc:
            raise WireError(str(exc)) from None


class _Scalar(Kind):
    identity = True

    def __init__(self, tp: type) -> None:
        self.tp = tp
        self.name = tp.__name__

    def check(self, value: Any) -> Any:
        if type(value) is not self.tp:
            raise TypeError(f"expected {self.name}, got {type(value).__name__}")
        return value


class _Int(Kind):
    """A 64-bit integer, signed (``int``) or unsigned (``UInt``)."""

    identity = True

    def __init__(self, name: str, lo: int, hi: int) -> None:
        self.name, self.lo, self.hi = name, lo, hi

    def check(self, value: Any) -> Any:
        if type(value) is not int:
            # bool is an int subclass but not an int here; IntEnums (ErrorCode) become ints.
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"expected int, got {type(value).__name__}")
            value = int(value)
        if not self.lo <= value <= self.hi:
            raise ValueError(f"{value} is outside {self.name}'s range [{self.lo}, {self.hi}]")
        return value

    def all_fit(self, values: list[Any]) -> bool:
        """Whether every item of a decoded array is an int in range (the token-id fast path)."""
        if not all(type(v) is int for v in values):
            return False
        return not values or (self.lo <= min(values) and max(values) <= self.hi)


class _Float(Kind):
    name = "float"

    def check(self, value: Any) -> Any:
        if type(value) is float:
            return value
        if type(value) is int:  # accepted as a convenience; stored (and sent) as a float
            return float(value)
        raise TypeError(f"expected float, got {type(value).__name__}")


class _Tuple(Kind):
    def __init__(self, item: Kind) -> None:
        self.item = item
        self.name = f"tuple[{item.name}, ...]"

    def check(self, value: Any) -> Any:
        if not isinstance(value, tuple):
            raise TypeError(f"expected {self.name}, got {type(value).__name__}")
        check = self.item.check
        return tuple([check(v) for v in value])

    def encode(self, value: Any, tensors: list[Tensor]) -> Any:
        if self.item.identity:
            return list(value)
        return [self.item.encode(v, tensors) for v in value]

    def decode(self, wire: Any, payload: Payload) -> Any:
        if type(wire) is not list:
            raise WireError(f"expected array for {self.name}, got {type(wire).__name__}")
        item = self.item
        if isinstance(item, _Int) and item.all_fit(wire):
            return tuple(wire)  # the hot path: token ids
        exact = WIRE_EXACT.get(item)
        if exact is not None and all(type(v) is exact for v in wire):
            return tuple(wire)
        decode = self.item.decode
        return tuple([decode(v, payload) for v in wire])


class _Pair(Kind):
    """``tuple[int, int]``: a half-open range ``[start, end)`` as a 2-element array."""

    name = "tuple[int, int]"

    def check(self, value: Any) -> Any:
        if not isinstance(value, tuple) or len(value) != 2:
            raise TypeError(f"expected a pair of ints, got {value!r}")
        return (_UINT.check(value[0]), _UINT.check(value[1]))

    def encode(self, value: Any, tensors: list[Tensor]) -> Any:
        return list(value)

    def decode(self, wire: Any, payload: Payload) -> Any:
        if type(wire) is not list:
            raise WireError(f"expected a 2-element array, got {type(wire).__name__}")
        return super().decode(tuple(wire), payload)


class _Optional(Kind):
    def __init__(self, inner: Kind) -> None:
        self.inner = inner
        self.identity = inner.identity
        self.name = f"{inner.name} | None"

    def check(self, value: Any) -> Any:
        return None if value is None else self.inner.check(value)

    def encode(self, value: Any, tensors: list[Tensor]) -> Any:
        return None if value is None else self.inner.encode(value, tensors)

    def decode(self, wire: Any, payload: Payload) -> Any:
        return None if wire is None else self.inner.decode(wire, payload)


class _Union(Kind):
    """A union of kinds whose wire forms differ (a map for a tensor, an array for a list)."""

    def __init__(self, options: list[Kind]) -> None:
        self.options = options
        self.name = " | ".join(o.name for o in options)

    def check(self, value: Any) -> Any:
        for option in self.options:
            try:
                return option.check(value)
            except (TypeError, ValueError):
                continue
        raise TypeError(f"expected {self.name}, got {type(value).__name__}")

    def encode(self, value: Any, tensors: list[Tensor]) -> Any:
        kind = _TENSOR if isinstance(value, Tensor) else self._kind_of(value)
        return kind.encode(value, tensors)

    def _kind_of(self, value: Any) -> Kind:
        for option in self.options:
            try:
                option.check(value)
            except (TypeError, ValueError):
                continue
            return option
        raise TypeError(f"expected {self.name}, got {type(value).__name__}")

    def decode(self, wire: Any, payload: Payload) -> Any:
        errors = []
        for option in self.options:
            try:
                return option.decode(wire, payload)
            except WireError as exc:
                errors.append(str(exc))
        raise WireError(f"expected {self.name}: {'; '.join(errors)}")


class _Tensor(Kind):
    """On the wire: ``{"dtype": str, "shape": [uint...], "nbytes": uint}``; bytes in the payload."""

    name = "Tensor"

    def check(self, value: Any) -> Any:
        if not isinstance(value, Tensor):
            raise TypeError(f"expected Tensor, got {type(value).__name__}")
        return value

    def encode(self, value: Any, tensors: list[Tensor]) -> Any:
        tensors.append(value)
        return {"dtype": value.dtype, "shape": list(value.shape), "nbytes": value.nbytes}

    def decode(self, wire: Any, payload: Payload) -> Any:
        if type(wire) is not dict:
            raise WireError(f"expected a tensor descriptor map, got {type(wire).__name__}")
        dtype, shape, nbytes = wire.get("dtype"), wire.get("shape"), wire.get("nbytes")
        if type(dtype) is not str or dtype not in DTYPE_SIZES:
            raise WireError(f"unknown tensor dtype {dtype!r}")
        if type(shape) is not list or len(shape) > MAX_TENSOR_DIMS:
            raise WireError(f"bad tensor shape {shape!r}")
        if not _UINT.all_fit(shape):
            raise WireError(f"bad tensor shape {shape!r}")
        if type(nbytes) is not int or nbytes != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise WireError(f"tensor nbytes {nbytes!r} disagrees with {dtype}{shape}")
        return Tensor(dtype, tuple(shape), payload.take(nbytes))


class _Record(Kind):
    """A nested record (a frozen dataclass) as a CBOR map with string keys."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name = cls.__name__

    def check(self, value: Any) -> Any:
        if type(value) is not self.cls:
            raise TypeError(f"expected {self.name}, got {type(value).__name__}")
        return value

    def encode(self, value: Any, tensors: list[Tensor]) -> Any:
        return encode_fields(value, tensors, {})

    def decode(self, wire: Any, payload: Payload) -> Any:
        if type(wire) is not dict:
            raise WireError(f"expected a {self.name} map, got {type(wire).__name__}")
        return decode_fields(self.cls, wire, payload)


_INT: Final = _Int("int", INT_MIN, INT_MAX)
_UINT: Final = _Int("uint", 0, UINT_MAX)
_TENSOR: Final = _Tensor()
_SCALARS: Final[dict[Any, Kind]] = {
    str: _Scalar(str),
    bool: _Scalar(bool),
    bytes: _Scalar(bytes),
    int: _INT,
    float: _Float(),
    Tensor: _TENSOR,
}


# Kinds whose decoded CBOR value is already valid when its type is exactly this one. Ints
# are not among them: a CBOR integer may lie outside the field's 64-bit range.
WIRE_EXACT: Final[dict[Kind, type]] = {_SCALARS[str]: str, _SCALARS[bool]: bool}


def kind_of(tp: Any) -> Kind:
    """The ``Kind`` for one annotation (resolved, not a string)."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated and args[0] is int and isinstance(args[1], _Unsigned):
        return _UINT
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _Tuple(kind_of(args[0]))
        if args == (int, int):
            return _Pair()
    if origin in (typing.Union, types.UnionType):
        options = [kind_of(a) for a in args if a is not type(None)]
        inner = options[0] if len(options) == 1 else _Union(options)
        return _Optional(inner) if type(None) in args else inner
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _Record(tp)
    raise TypeError(f"no wire form for annotation {tp!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    """One compiled field: its name, kind, and default (``dataclasses.MISSING`` if required)."""

    name: str
    kind: Kind
    default: Any
    default_factory: Callable[[], Any] | Any

    @property
    def required(self) -> bool:
        return self.default is _MISSING and self.default_factory is _MISSING

    def default_value(self) -> Any:
        if self.default is not _MISSING:
            return self.default
        return self.default_factory()


_COMPILED: dict[type, tuple[Field, ...]] = {}


def compile_fields(cls: type) -> tuple[Field, ...]:
    """The compiled fields of a dataclass, in declaration (= wire) order (cached per class)."""
    fields = _COMPILED.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        fields = tuple(
            Field(f.name, kind_of(hints[f.name]), f.default, f.default_factory)
            for f in dataclasses.fields(cls)
            if f.init
        )
        _COMPILED[cls] = fields
    return fields


def check_fields(obj: object) -> None:
    """Validate (and normalise) every field of a freshly constructed record in place."""
    for field in compile_fields(type(obj)):
        value = getattr(obj, field.name)
        try:
            checked = field.kind.check(value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{type(obj).__name__}.{field.name}: {exc}") from None
        if checked is not value:
            object.__setattr__(obj, field.name, checked)


def encode_fields(obj: object, tensors: list[Tensor], into: dict[Any, Any]) -> dict[Any, Any]:
    """Add ``obj``'s fields to the map ``into`` (string keys, declaration order).

    A field holding its default value is left out: the receiver fills in defaults, and a
    decode frame then carries only what changes per token (protocol/README.md §3).
    """
    for field in compile_fields(type(obj)):
        value = getattr(obj, field.name)
        if _is_default(field, value):
            continue
        into[field.name] = value if field.kind.identity else field.kind.encode(value, tensors)
    return into


def _is_default(field: Field, value: Any) -> bool:
    default = field.default
    if default is _MISSING:
        return False  # required, or a factory default (never cheaper to compare)
    if value is default:
        return True
    # Same type and equal: 1 is not omitted for a float default of 1.0, nor True for 1.
    return type(value) is type(default) and not isinstance(value, Tensor) and value == default


def decode_fields(cls: Any, wire: dict[Any, Any], payload: Payload) -> Any:
    """Build a ``cls`` from a decoded CBOR map; unknown keys are ignored (a newer peer).

    Values are validated here, so construction bypasses ``__init__``; the class's own
    cross-field ``_validate`` still runs. Raises ``WireError``.
    """
    obj: Any = object.__new__(cls)
    for field in compile_fields(cls):
        if field.name in wire:
            value = wire[field.name]
            if type(value) is WIRE_EXACT.get(field.kind):
                object.__setattr__(obj, field.name, value)
                continue
            try:
                value = field.kind.decode(value, payload)
            except WireError as exc:
                raise WireError(f"{cls.__name__}.{field.name}: {exc}") from None
        elif field.required:
            raise WireError(f"{cls.__name__} is missing required field {field.name!r}")
        else:
            value = field.default_value()
        object.__setattr__(obj, field.name, value)
    validate = getattr(obj, "_validate", None)
    if validate is not None:
        try:
            validate()
        except (TypeError, ValueError) as exc:
            raise WireError(f"{cls.__name__}: {exc}") from None
    return obj
