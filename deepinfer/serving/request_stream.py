"""One request's stream on the event loop thread, and the two callbacks by which the engine
thread hands it things (run there through `call_soon_threadsafe`):

    engine thread                          event loop thread
    -------------                          -----------------
    step's outputs, or the error  ------>  deliver: put_nowait into each request's asyncio.Queue
                                               --> `async for out in handle` (RequestHandle)
    an add accepted or refused    ------>  resolve: the add()'s future (unless the caller gave up)
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from deepinfer.outputs import RequestOutput


class _Aborts(Protocol):
    """What a handle needs of the engine loop: `EngineLoop.abort`."""

    def abort(self, request_id: str) -> None: ...


class RequestHandle:
    """The asyncio side of one request: `async for out in handle` yields its RequestOutputs.

    The last output has `finished` set; an engine failure is raised from the iteration.
    """

    def __init__(self, request_id: str, num_prompt_tokens: int, queue: asyncio.Queue,
                 engine_loop: _Aborts):
        self.request_id, self.num_prompt_tokens = request_id, num_prompt_tokens
        self._queue, self._engine_loop = queue, engine_loop
        self.finished = False

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Abort unless finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._engine_loop.abort(self.request_id)


def resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    """Settle an add()'s future: None (accepted) or the refusal `exc`."""
    if future.done():  # the caller gave up (its abort follows in the command queue)
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def deliver(batch: list[tuple[asyncio.Queue, object]]) -> None:
    """Put each item (a RequestOutput or an exception) into its request's queue."""
    for queue, item in batch:
        queue.put_nowait(item)
