"""A lean HTTP/1.1 client for `bench serve`'s streamed requests: one POST per connection over
asyncio streams, the chunked body read as it arrives and split into server-sent events.

A general client (httpx) spends a few hundred microseconds of CPU per event; on a small machine
that the benchmark shares with the server, that is CPU taken from the server under test. This
one does only what the benchmark needs (plain http, a JSON body, chunked or sized responses).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

SSE_DATA = b"data: "


class StreamedResponse:
    """The status and headers of a response, then its body as it arrives."""

    def __init__(self, reader: asyncio.StreamReader, status: int, headers: dict[str, str]):
        self.status = status
        self._reader = reader
        self._chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self._length = int(headers.get("content-length", "0") or 0)

    async def body_parts(self) -> AsyncIterator[bytes]:
        if not self._chunked:
            yield await self._reader.readexactly(self._length)
            return
        while True:
            size = int((await self._reader.readline()).split(b";")[0], 16)
            if size == 0:
                return
            part = await self._reader.readexactly(size)
            await self._reader.readexactly(2)  # the chunk's CRLF
            yield part

    async def read(self) -> bytes:
        return b"".join([part async for part in self.body_parts()])

    async def event_data(self) -> AsyncIterator[bytes]:
        """The data of each server-sent event."""
        pending = b""
        async for part in self.body_parts():
            *events, pending = (pending + part).split(b"\n\n")
            for event in events:
                if event.startswith(SSE_DATA):
                    yield event[len(SSE_DATA) :]


@contextlib.asynccontextmanager
async def post_json(
    base_url: str, path: str, body: dict[str, Any], headers: dict[str, str]
) -> AsyncIterator[StreamedResponse]:
    """POST `body` as JSON to `base_url + path` (plain http); the response, streamed."""
    url = urlsplit(base_url)
    if url.scheme != "http" or url.hostname is None:
        raise ValueError(f"the benchmark client speaks plain http only, got {base_url!r}")
    port = url.port or 80
    reader, writer = await asyncio.open_connection(url.hostname, port)
    try:
        payload = json.dumps(body).encode()
        lines = [
            f"POST {url.path.rstrip('/')}{path} HTTP/1.1",
            f"Host: {url.hostname}:{port}",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in headers.items()),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        status = int((await reader.readline()).split()[1])
        received: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            received[name.strip().lower()] = value.strip()
        yield StreamedResponse(reader, status, received)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
