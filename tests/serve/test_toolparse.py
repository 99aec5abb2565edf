"""Tool calls parsed out of fixed model replies, for each format, whole and streamed."""

from __future__ import annotations

import json

import pytest

from meshnode.serve.toolparse import ToolCallStream, ToolDelta, ToolFormat

WEATHER_ARGS = '{"city": "Paris", "days": [1, {"note": "}\\" ]"}]}'

#: (format, reply, expected content, expected [(name, arguments)])
CASES = [
    (
        ToolFormat.HERMES,
        "Let me look.\n<tool_call>\n"
        f'{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me look.",
        [("get_weather", WEATHER_ARGS), ("get_time", "{}")],
    ),
    (
        ToolFormat.HERMES,  # keys in another order: the call comes whole at its end
        '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
        "",
        [("f", '{"a": 1}')],
    ),
    (
        ToolFormat.HERMES,  # arguments given as a JSON string are passed on as they are
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        "",
        [("f", '{"a": 1}')],
    ),
    (
        ToolFormat.LLAMA3_JSON,
        '  {"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        "",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "CET"}')],
    ),
    (
        ToolFormat.LLAMA3_JSON,
        '<|python_tag|>{"name": "f", "parameters": {"x": [1, 2]}}',
        "",
        [("f", '{"x": [1, 2]}')],
    ),
    (
        ToolFormat.MISTRAL,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")],
    ),
]

#: Replies that are plain text for their format: nothing is parsed, nothing is lost.
PLAIN = [
    (ToolFormat.HERMES, "No calls here, only <tool talk and {braces}."),
    (ToolFormat.HERMES, 'A call cut short <tool_call>\n{"name": "get_w'),
    (ToolFormat.LLAMA3_JSON, 'The JSON {"name": "x"} comes after text.'),
    (ToolFormat.MISTRAL, "[TOOL_CALLS] not JSON at all"),
]


def _stream(fmt: ToolFormat, reply: str, step: int) -> tuple[str, list[tuple[str, str]], str]:
    """Feed ``reply`` ``step`` characters at a time; (content, calls reassembled, ids ok)."""
    parser = ToolCallStream(fmt)
    pieces: list[ToolDelta] = [parser.push(reply[i : i + step]) for i in range(0, len(reply), step)]
    pieces.append(parser.finish())
    content = "".join(p.content for p in pieces)
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        for call in piece.calls:
            if call.id is not None:
                assert call.index not in calls, "id and name come once per call"
                assert call.id.startswith("call_")
                assert call.name is not None
                calls[call.index] = [call.name, ""]
            else:
                assert call.name is None
            calls[call.index][1] += call.arguments
    final = [(c.name, c.arguments) for c in parser.parsed]
    assert [tuple(v) for _, v in sorted(calls.items())] == final, "deltas reassemble"
    return content, final, reply


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), CASES)
@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_calls_are_parsed_whole_and_streamed(
    fmt: ToolFormat, reply: str, content: str, calls: list[tuple[str, str]], step: int
) -> None:
    got_content, got_calls, _ = _stream(fmt, reply, step)
    assert got_content == content
    assert got_calls == calls
    for _, arguments in got_calls:
        json.loads(arguments)  # OpenAI's arguments are JSON text


@pytest.mark.parametrize(("fmt", "reply"), PLAIN)
@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_plain_replies_pass_through_unchanged(fmt: ToolFormat, reply: str, step: int) -> None:
    content, calls, _ = _stream(fmt, reply, step)
    assert (content, calls) == (reply, [])


def test_arguments_stream_before_the_call_ends() -> None:
    parser = ToolCallStream(ToolFormat.HERMES)
    first = parser.push('<tool_call>\n{"name": "f", "arguments": {"q": "to')
    assert [(c.index, c.name, c.arguments) for c in first.calls] == [(0, "f", '{"q": "to')]
    more = parser.push('kyo"}}\n</tool_call>')
    assert [(c.id, c.arguments) for c in more.calls] == [(None, 'kyo"}')]
    assert parser.finish() == ToolDelta()


def test_a_marker_prefix_is_held_back_until_it_is_decided() -> None:
    parser = ToolCallStream(ToolFormat.HERMES)
    assert parser.push("Hi <tool").content == "Hi"
    assert parser.push("bar>").content == " <toolbar>"


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), [c for c in CASES if len(c[3]) > 1])
@pytest.mark.parametrize("step", [1, 10_000])
def test_one_call_only_when_parallel_calls_are_off(
    fmt: ToolFormat, reply: str, content: str, calls: list[tuple[str, str]], step: int
) -> None:
    parser = ToolCallStream(fmt, single=True)
    pieces = [parser.push(reply[i : i + step]) for i in range(0, len(reply), step)]
    pieces.append(parser.finish())
    assert "".join(p.content for p in pieces) == content
    assert {c.index for p in pieces for c in p.calls} == {0}
    assert [(c.name, c.arguments) for c in parser.parsed] == calls[:1]
