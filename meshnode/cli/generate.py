"""``meshnode generate``: one reply from a local model, streamed to stdout."""
