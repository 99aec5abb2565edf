"""The scoring side of speculation: one forward that returns only the rows it needs.

A verify pass feeds ``[last, d_1 … d_k]`` and needs the logits of all k + 1 rows; a
draft's catch-up or decode step needs only its last row. ``Stage.forward(out_rows=r)``
lets the other rows stop after writing their K/V in the last layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshnode.engine.kv_cache import KVCache
from meshnode.engine.model import HostArray, Stage, token_ids


def forward_rows(
    stage: Stage, tokens: Sequence[int], start_pos: int, cache: KVCache, rows: int
) -> HostArray:
    """Logits ``[rows, V]`` of the last ``rows`` of ``tokens`` fed at ``start_pos``, on the host.

    ``forward`` truncates the cache to ``start_pos`` first, so this is also the rollback.
    Raises ``ValueError`` if the tokens do not fit the cache.
    """
    logits = stage.forward(token_ids(tokens), start_pos, cache, out_rows=rows)
    host: HostArray = stage.backend.to_numpy(logits)
    return host
