"""Names for the kernels a factory compiles once per compile-time value (a format id, a tile
form): :func:`variant`.

numba names a compiled function's symbol by its qualified name, its argument types and a
number counted in the compiling process (``unique_id``), and looks a function up by that
symbol once its code is in the process's JIT. Two variants of one closure (the product of
Q4_K and the product of Q8_0) share the qualified name and the argument types, so in two
processes they can get the same symbol: a variant loaded from numba's disk cache, compiled
in another process (a compile-ahead worker, another node, an earlier start), then resolves
to whichever same-named code this process holds first -- its calls and its address land in
the other variant's code, which reads the weights in the wrong format (NaN and garbage:
the exact mixture-of-experts tests failed so in two CI runs, ``tests/engine/
test_kernel_cache_keys.py`` rebuilds the collision). numba treats functions linked into a
caller as ``linkonce_odr``: one name, one body. :func:`variant` gives each variant its own
name, so that stays true.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["variant"]

F = TypeVar("F", bound=Callable[..., Any])


def variant(*values: int | bool) -> Callable[[F], F]:
    """Decorate a function a factory makes (below numba's decorator): its name and
    qualified name gain the factory's compile-time ``values`` (``chunk`` of ``(2, 8)``:
    ``chunk__2_8``), before numba reads them. The values are plain ints and bools, what the
    closure captures (numba's disk cache keys a closure by them too)."""
    if not all(type(v) in (int, bool) for v in values):
        raise TypeError(f"a variant is named by ints and bools, not {values!r}")
    suffix = "__" + "_".join(str(int(v)) for v in values)

    def name(fn: F) -> F:
        fn.__name__ += suffix
        fn.__qualname__ += suffix
        return fn

    return name
