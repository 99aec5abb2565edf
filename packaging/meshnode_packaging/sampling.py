"""The model's own sampling defaults: what a GGUF file (``general.sampling.*``) or a
checkpoint's ``generation_config.json`` ships, under the names API requests use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GGUF_SAMPLING_KEYS", "SAMPLING_NAMES", "sampling_defaults", "sampling_numbers"]

#: Sampling settings a model may ship, under the names API requests use for them.
SAMPLING_NAMES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
#: llama.cpp's GGUF keys for them (``general.sampling.*``, written by convert_hf_to_gguf
#: from generation_config.json).
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def sampling_defaults(source: object) -> dict[str, float | int]:
    """The sampling settings ``source`` ships (its ``sampling_defaults``: GGUF
    ``general.sampling.*``, a checkpoint's ``generation_config.json``, a package's
    ``generation.sampling``); empty for a source that carries none."""
    found = getattr(source, "sampling_defaults", None)
    return dict(found) if isinstance(found, dict) else {}


def sampling_numbers(values: dict[str, Any]) -> dict[str, float | int]:
    """The entries of ``values`` named in :data:`SAMPLING_NAMES` whose value is a number
    (a JSON ``null`` or a string is not a setting)."""
    return {
        name: values[name]
        for name in SAMPLING_NAMES
        if isinstance(values.get(name), int | float) and not isinstance(values[name], bool)
    }
