"""What speculation needs from a model: a stage with embeddings and head, and its cache.

``meshnode.engine.Stage`` satisfies ``HeadStage`` when built with ``embed=True`` and
``head=True``; the protocols keep this package's drivers usable with any object that
forwards token ids to logits rows (a whole model, a draft, the target's first layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt


class Cache(Protocol):
    """A per-sequence KV cache: ``length`` positions hold valid K/V."""

    @property
    def length(self) -> int: ...

    def truncate(self, n: int) -> None: ...


class HeadStage(Protocol):
    """A layer range with embeddings and head: token ids in, logits rows out."""

    def new_cache(self, max_tokens: int) -> Any: ...

    def forward(
        self, inputs: Any, start_pos: int, cache: Any, *, out_rows: int | None = None
    ) -> Any: ...


def forward_rows(
    stage: HeadStage, tokens: Sequence[int], start_pos: int, cache: Cache, rows: int
) -> npt.NDArray[np.float32]:
    """Logits of the last ``rows`` of ``tokens`` fed at ``start_pos``, on the host.

    ``forward`` truncates the cache to ``start_pos`` first, so this is also the rollback.
    """
    ids = np.asarray(tokens, dtype=np.int64)
    logits = stage.forward(ids, start_pos, cache, out_rows=rows)
    host = logits.get() if hasattr(logits, "get") else logits  # CuPy → NumPy
    return np.asarray(host, dtype=np.float32).reshape(rows, -1)
