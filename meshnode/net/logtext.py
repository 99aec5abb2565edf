"""Text from the network in the node's log: one line per record, bounded per peer.

A member's ``Error`` text (or any other string a peer chose) must not forge log lines nor
fill the disk (issue 36, item 9: newlines in an ``Error`` wrote lines that read as the
node's own, and 2 s of ``Error`` frames wrote 30 MB):

- :class:`OneLineFormatter` escapes every control character of a record's message
  (``\\n`` becomes the two characters ``\\`` ``n``), whatever put it there; a traceback
  still follows on its own lines, as the logging module writes it.
- :func:`remote_text` cuts a peer's string to :data:`MAX_REMOTE_TEXT_CHARS` and escapes it.
- :class:`meshnode.net.limits.TokenBuckets` bounds the lines each peer can cause.
"""

from __future__ import annotations

import logging
import re
from typing import Final

__all__ = [
    "MAX_REMOTE_TEXT_CHARS",
    "OneLineFormatter",
    "one_line",
    "remote_text",
]

#: Characters of a peer's text kept in a log line: an Error's message is a sentence or
#: two; the protocol lets a header carry 64 KiB.
MAX_REMOTE_TEXT_CHARS: Final = 300
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text: str) -> str:
    """``text`` with every control character escaped (``\\n``, ``\\x1b``, ``\\u2028``)."""
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    if char in named:
        return named[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def remote_text(text: str) -> str:
    """A peer's ``text`` for a log line: escaped and cut to :data:`MAX_REMOTE_TEXT_CHARS`."""
    if len(text) <= MAX_REMOTE_TEXT_CHARS:
        return one_line(text)
    cut = len(text) - MAX_REMOTE_TEXT_CHARS
    return f"{one_line(text[:MAX_REMOTE_TEXT_CHARS])}… ({cut} more characters)"


class OneLineFormatter(logging.Formatter):
    """A formatter whose records' messages never span lines (module docstring)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)
