"""From the engine thread to the event loop: request outputs, and the text they stream.

The engine hands each RequestOutput to its RequestStream on the engine thread; iterating the
stream blocks. Blocking a thread per request would cost a thread for each of hundreds of open
streams, so instead the bridge becomes the stream's sink (RequestStream.set_sink): the engine
thread appends the output to one shared list, and at most one `call_soon_threadsafe` per burst wakes the loop,
which sorts the outputs into per-request async streams. No thread waits, and the loop never
calls into the engine per token.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from functools import partial

log = logging.getLogger(__name__)


class AsyncRequestStream:
    """One request's outputs on the event loop, in the order the engine produced them."""

    def __init__(self, request_id: str, engine_stream):
        self.request_id = request_id
        self.finished = False  # the engine has finished the request (no abort needed)
        self._engine_stream = engine_stream
        self._items: deque = deque()
        self._ready = asyncio.Event()

    def push(self, out) -> None:
        self._items.append(out)
        if out.finished:
            self.finished = True
            self._engine_stream = None  # nothing more can arrive; drop the reference cycle
        self._ready.set()

    async def get(self, timeout: float):
        """The next output, or None when none came within `timeout` seconds (the caller checks
        its client is still there, then waits again)."""
        if not self._items:
            self._ready.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._ready.wait()
            except TimeoutError:
                return None
        return self._items.popleft()


class EngineBridge:
    """Moves outputs from the engine thread to AsyncRequestStreams on `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list = []
        self._wakeup_scheduled = False

    def attach(self, engine_stream) -> AsyncRequestStream:
        """Call on the loop right after engine.add_request(..., stream=True)."""
        target = AsyncRequestStream(engine_stream.request_id, engine_stream)
        # outputs already queued arrive first, in order; the engine calls the bridge from now on
        engine_stream.set_sink(partial(self._hand_over, target))
        return target

    def _hand_over(self, target: AsyncRequestStream, out) -> None:
        """Engine thread: must return at once and never raise into the step loop."""
        with self._lock:
            self._pending.append((target, out))
            if self._wakeup_scheduled:
                return
            self._wakeup_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is waiting
            pass

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._wakeup_scheduled = False
        for target, out in batch:
            target.push(out)


class TextDeltas:
    """Token ids -> the text to stream, a piece at a time, ending exactly on the engine's text.

    Decoding the whole output for every token would cost O(n^2); instead (as vLLM does) only
    the tokens since the last stable point are decoded, with one earlier chunk as context, and
    text ending in U+FFFD waits for the rest of a split UTF-8 character. With stop strings the
    last (longest stop - 1) characters are held back, since the engine cuts its text where a
    stop string begins and streamed text cannot be taken back.
    """

    def __init__(self, decode, stop: tuple[str, ...] = ()):
        self._decode = decode
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""  # decoded so far, up to the last stable point
        self._sent = 0  # characters of _text already streamed
        self._prefix_offset = 0
        self._read_offset = 0

    def update(self, token_ids: list[int]) -> str:
        """token_ids: the request's output so far (cumulative). Returns new text to send."""
        if len(token_ids) > self._read_offset:
            before = self._decode(token_ids[self._prefix_offset:self._read_offset])
            after = self._decode(token_ids[self._prefix_offset:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self._text += after[len(before):]
                self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        end = len(self._text) - self._hold
        if end <= self._sent:
            return ""
        delta, self._sent = self._text[self._sent:end], end
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (authoritative: stop strings are cut from it)."""
        sent = self._text[:self._sent]
        if not final_text.startswith(sent):
            log.warning("streamed text diverged from the final text after %d characters", self._sent)
        return final_text[len(sent):]
