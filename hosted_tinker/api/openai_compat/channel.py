"""`Channel`: events from the cycle thread to one request's coroutine, waking the event loop once per batch."""

from __future__ import annotations

import asyncio
from collections import deque


class Channel:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: deque = deque()
        self._event = asyncio.Event()
        self._armed = False
        self.closed = False

    def put(self, item) -> None:  # any thread
        if self.closed:
            return
        self._items.append(item)
        if not self._armed:
            self._armed = True
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop is gone: the server is shutting down
                pass

    def _wake(self) -> None:
        self._armed = False
        self._event.set()

    async def get(self) -> list:
        while not self._items:
            self._event.clear()
            if self._items:
                break
            await self._event.wait()
        out = []
        while self._items:
            out.append(self._items.popleft())
        return out

    def close(self) -> None:  # the consumer left: drop whatever comes
        self.closed = True
        self._items.clear()
