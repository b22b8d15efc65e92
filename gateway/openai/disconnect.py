"""Cancel a REST request's handler when its client disconnects.

Starlette notices a disconnect only while it streams a response. A request that has not
sent its first byte yet (a stream waiting for every choice's first event, see endpoint.py)
or a non-streaming one would otherwise run to the end after its client left, holding KV
blocks on both workers. This ASGI middleware reads the client's messages itself: on
`http.disconnect` it cancels the handler, which closes every generate() generator, and the
gateway aborts the request on both workers (gateway/segment.py's cleanup).
"""
from __future__ import annotations

import asyncio


class CancelOnDisconnect:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        inbox: asyncio.Queue = asyncio.Queue(maxsize=8)    # body chunks in flight, bounded
        handler = asyncio.ensure_future(self.app(scope, inbox.get, send))

        async def pump():
            while True:
                msg = await receive()
                await inbox.put(msg)          # the handler may also wait for the disconnect
                if msg["type"] == "http.disconnect":
                    handler.cancel()
                    return

        reader = asyncio.ensure_future(pump())
        try:
            await handler
        except asyncio.CancelledError:
            if not reader.done():             # cancelled from outside, not by a disconnect
                raise
        finally:
            reader.cancel()
