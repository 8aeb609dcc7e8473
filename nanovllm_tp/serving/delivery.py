"""A request's outputs delivered to its client: whole (every stream's final output, the requests aborted if the
client goes away meanwhile) or as server-sent events (a chunk whenever any stream has news, the open requests
aborted if the client goes away mid-stream)."""
import asyncio
import contextlib
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from nanovllm_tp.serving.engine_client import EngineDead, RequestStream
from nanovllm_tp.serving.responses import ApiError, ResponseBuilder, error_body, json_text

DISCONNECT_CHECK_S = 0.5     # how often a handler waiting for whole outputs looks for its client


async def finals(request: Request, streams: list[RequestStream], abort) -> list:
    """The final output of every stream; every request is aborted if the client goes away meanwhile (looked for
    every DISCONNECT_CHECK_S, however busy the streams are)."""
    ready, finals = streams[0].ready, [None] * len(streams)
    next_check = time.monotonic() + DISCONNECT_CHECK_S
    try:
        while not all(s.done for s in streams):
            for i, s in enumerate(streams):
                out = s.take()
                finals[i] = out if out is not None else finals[i]
            if all(s.done for s in streams):
                break
            ready.clear()
            if not any(s.has_news for s in streams):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ready.wait(), timeout=max(0.0, next_check - time.monotonic()))
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_CHECK_S
                if await request.is_disconnected():
                    abort()
                    raise ApiError(499, "the client closed the connection") from None
    except EngineDead as exc:
        raise ApiError(503, str(exc), "service_unavailable") from None
    return finals


def stream(streams: list[RequestStream], builder: ResponseBuilder, include_usage: bool, choice,
            abort) -> StreamingResponse:
    """Server-sent events: a chunk each time any of the streams has news (a stream's outputs not yet sent are
    merged into one chunk), an error event after the chunk that ends a choice the engine ended with an error
    (its grammar failed), a usage chunk if asked, then [DONE]; a stream the engine could not finish ends with an
    error event (503) and [DONE]."""
    async def events():
        ready, finals, started = streams[0].ready, {}, set()
        stopped = None                       # why the engine could not finish them
        try:
            while not all(s.done for s in streams):
                choices, failed = [], []
                for i, s in enumerate(streams):
                    try:
                        item = s.take()
                    except EngineDead as exc:       # an error event, then [DONE] as after any other end
                        stopped = str(exc)
                        yield _sse(error_body(str(exc), "service_unavailable", 503))
                        yield "data: [DONE]\n\n"
                        return
                    if item is None:
                        continue
                    for c in item.outputs:
                        choices.append(choice(i, item, c, (i, c.index) in started))
                        started.add((i, c.index))
                        if c.error:
                            failed.append((i * builder.n + c.index, c.error))
                    if item.finished:
                        finals[i] = item
                if choices:
                    yield _sse(builder.chunk(choices))
                if failed:
                    yield _sse(builder.failure(failed))
                ready.clear()
                if not all(s.done for s in streams) and not any(s.has_news for s in streams):
                    await ready.wait()
            if include_usage:
                yield _sse(builder.chunk([], builder.usage([finals[i] for i in sorted(finals)])))
            yield "data: [DONE]\n\n"
        finally:
            open_ids = [i for i, s in enumerate(streams) if not s.done]
            if open_ids:                     # the client went away (or the engine failed) mid-stream
                abort(open_ids, stopped)

    return StreamingResponse(events(), media_type="text/event-stream")


def _sse(body: dict) -> str:
    return f"data: {json_text(body)}\n\n"
