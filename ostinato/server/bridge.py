"""The bridge from an asyncio request handler to the engine thread.

A `Run` submits one job and reads its events as they come: the engine thread hands
each event to the request's event loop with `loop.call_soon_threadsafe`, so the engine
never waits for a slow client and the loop never waits for the engine. A watcher polls
the connection while the job runs; when the client has gone, or the request ends early
(Starlette cancels a stream whose client disconnected), the job's cancel event is set
and the engine stops at its next token, or skips the job if it is still queued.
"""
from __future__ import annotations

import asyncio

from starlette.requests import Request

from ostinato.server.worker import EngineWorker, Failed, Finished, Job


class Run:
    def __init__(self, worker: EngineWorker, job: Job, request: Request):
        self.job = job
        self.done = False
        self.client_gone = False
        self._events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(event) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(self._events.put_nowait, event)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                job.cancel.set()

        job.emit = emit
        worker.submit(job)
        self._watcher = asyncio.create_task(self._watch(request))

    async def _watch(self, request: Request, every_s: float = 0.1) -> None:
        while not self.job.cancel.is_set():
            if await request.is_disconnected():
                self.client_gone = True
                self.job.cancel.set()
                return
            await asyncio.sleep(every_s)

    async def next(self):
        """The next event: a Token, then Finished or Failed (the last one)."""
        event = await self._events.get()
        if isinstance(event, (Finished, Failed)):
            self.done = True
        return event

    def close(self) -> None:
        """The request is over, however it ended; a job still running is cancelled."""
        if not self.done:
            self.job.cancel.set()
        self._watcher.cancel()
