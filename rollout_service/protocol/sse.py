"""Server-sent events: the framing of every streamed response, both ways.

The service (``api/openai.py``) frames each chunk of a streamed OpenAI response as
one event, ``data: <JSON>\\n\\n``, and ends the stream with ``data: [DONE]\\n\\n``
(OpenAI's convention; an error after the first chunk is one more event whose data
is an ``ErrorResponse``). The SGLang engine reads its server's ``/generate`` stream,
and tests read the service's, with :func:`read_events`. JSON never holds a raw
newline, so one event is one ``data:`` line.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

from pydantic import BaseModel

DONE = "[DONE]"
"""The data of the event that ends a stream."""


def encode_event(data: str) -> bytes:
    """One event carrying ``data`` (a single line)."""
    if "\n" in data or "\r" in data:
        raise ValueError("event data must be one line (JSON without raw newlines)")
    return f"data: {data}\n\n".encode()


def encode_message(message: BaseModel) -> bytes:
    """One event carrying ``message`` as JSON."""
    return encode_event(message.model_dump_json())


DONE_EVENT = encode_event(DONE)


async def read_events(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """The data of each event in a stream's lines, up to (not including) ``[DONE]``.

    Follows the SSE rules the servers here use: ``data:`` lines of one event (the
    space after the colon is optional) are joined with newlines, a blank line ends
    the event, comments (``:``) and other fields (``event:``, ``id:``) are skipped.
    """
    data: list[str] = []
    async for line in lines:
        line = line.rstrip("\r\n")
        if not line:
            if data:
                event = "\n".join(data)
                data = []
                if event == DONE:
                    return
                yield event
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value.removeprefix(" "))
    if data and "\n".join(data) != DONE:
        yield "\n".join(data)
