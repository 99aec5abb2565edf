"""One sampling record: the API, the record and the wire agree on fields and defaults."""

from __future__ import annotations

import dataclasses

import pytest
from meshnode_protocol import Sampling

from meshnode.engine.sampling import GREEDY, SamplingParams
from meshnode.node.wire import sampling_from_wire, sampling_to_wire
from meshnode.serve import schemas as s

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}


def _values(record: object) -> dict[str, object]:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(SamplingParams)}


def test_the_wire_schema_has_the_records_fields_and_defaults() -> None:
    # An omitted wire field means the record's default, and every field crosses the wire.
    assert [f.name for f in dataclasses.fields(Sampling)] == [
        f.name for f in dataclasses.fields(SamplingParams)
    ]
    assert _values(Sampling()) == _values(SamplingParams())
    assert sampling_from_wire(Sampling()) == SamplingParams()


def test_the_defaults_are_openais() -> None:
    defaults = SamplingParams()
    assert defaults.temperature == 1.0
    assert not defaults.greedy
    assert not defaults.penalized
    assert GREEDY.greedy
    assert dataclasses.replace(GREEDY, temperature=1.0) == defaults


@pytest.mark.parametrize("model", [s.ChatCompletionRequest, s.CompletionRequest])
def test_a_request_without_sampling_fields_gets_the_records_defaults(
    model: type[s.ChatCompletionRequest] | type[s.CompletionRequest],
) -> None:
    body = model.model_validate(CHAT if model is s.ChatCompletionRequest else TEXT)
    assert body.sampling() == SamplingParams()


def test_every_field_goes_from_the_request_to_the_wire_and_back() -> None:
    fields = {
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.9,
        "min_p": 0.05,
        "seed": -3,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
    }
    assert set(fields) == s.SAMPLING_FIELDS
    record = s.ChatCompletionRequest.model_validate({**CHAT, **fields}).sampling()
    assert _values(record) == {**fields, "seed": 2**64 - 3}  # folded into the unsigned range
    assert sampling_from_wire(sampling_to_wire(record)) == record


def test_integers_in_float_fields_become_floats() -> None:
    # JSON ``"temperature": 0`` arrives as an int; the wire codec types its fields strictly.
    record = SamplingParams(temperature=0, top_p=1)
    assert isinstance(record.temperature, float)
    assert isinstance(record.top_p, float)
    assert sampling_from_wire(sampling_to_wire(record)) == record
