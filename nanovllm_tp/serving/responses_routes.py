"""OpenAI's Responses API on the chat path: POST /v1/responses (answered whole or as semantic events), GET and
DELETE /v1/responses/{id} (the stored responses).

A request becomes a /v1/chat/completions body (responses_request.py): its messages go through the model's chat
template, its tools, sampling and limits through the same checks, and the engine request is submitted and
delivered as a chat's is (RouteContext, delivery.finals). The answer is read as a chat answer is (a reasoning
parser's think block, then function calls: tool_calls.py) and written as output items (responses_output.py). A
stored response (store=true, OpenAI's default) keeps its conversation in the HTTP process (responses_store.py) for
a follow-up's previous_response_id."""
import re

from fastapi import Request
from fastapi.responses import StreamingResponse

from nanovllm_tp.serving.delivery import finals
from nanovllm_tp.serving.engine_client import EngineDead
from nanovllm_tp.serving.limits import check_request
from nanovllm_tp.serving.reasoning import ThinkSplitter, split_reasoning
from nanovllm_tp.serving.responses import ApiError
from nanovllm_tp.serving.responses_output import ResponseWriter, new_id, response_usage
from nanovllm_tp.serving.responses_request import ResponsesRequest, assistant_message
from nanovllm_tp.serving.responses_store import ResponseStore
from nanovllm_tp.serving.route_context import RouteContext, client_of
from nanovllm_tp.serving.tool_calls import new_call_id


_CHAT_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format"}
_CHAT_NAME = re.compile(r"\b(max_tokens|response_format)\b")


def _refused(exc: Exception) -> ApiError:
    """A 400 for what the chat path refused, its message naming the fields as this client wrote them (the chat
    body's max_tokens is the request's max_output_tokens)."""
    message = exc.message if isinstance(exc, ApiError) else str(exc)
    return ApiError(400, _CHAT_NAME.sub(lambda m: _CHAT_NAMES[m.group(1)], message))


def _ending(c) -> tuple[str, dict | None]:
    """(status, error) of a finished completion: max_output_tokens (or the context) reached is "incomplete"."""
    if c.finish_reason == "length":
        return "incomplete", None
    if c.finish_reason == "abort":
        return "failed", {"code": "server_error", "message": c.error or "the engine aborted the request"}
    return "completed", None


def add_responses_routes(app, ctx: RouteContext, store: ResponseStore | None = None) -> None:
    config, encoder, engine = ctx.config, ctx.encoder, ctx.engine
    store = store if store is not None else ResponseStore()
    parser = config.reasoning_parser

    def not_found(response_id: str, param: str | None = None) -> ApiError:
        return ApiError(404, f"Response with id '{response_id}' not found: never made here, made with "
                             "store=false, deleted, or evicted (this server keeps the last "
                             f"{store.max_responses} responses within a memory bound, and none across restarts)",
                        "not_found_error", param)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        lora = ctx.check_model(body.model)
        history = []
        if body.previous_response_id is not None:
            prior = store.get(body.previous_response_id)
            if prior is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            history = prior.messages
        try:
            chat = body.as_chat(history)
            tools = ctx.tool_mode(chat)
            params = chat.sampling_params(tools, ctx.model.sampling_defaults)
            check_request(config, params)
            prompt = await encoder.chat([m.as_template_message() for m in chat.messages], True, None,
                                        chat.template_tools(), client=client_of(request))
        except (ValueError, TypeError) as exc:
            raise _refused(exc) from None
        except Exception as exc:          # the template's own errors (jinja raises its own types)
            raise ApiError(400, f"the chat template failed on these messages: {exc}") from None
        rid = engine.new_request_id("resp")
        try:
            streams = await ctx.submit_all(rid, [prompt], params, body.priority, lora, request)
        except ApiError as exc:           # the engine's own checks (SamplingParams, the context)
            raise (_refused(exc) if exc.status == 400 else exc) from None
        writer = ResponseWriter(new_id("resp"), lora[0] if lora else ctx.model.name, body, params, body.stream)
        if tools is not None and tools.choice == "none":
            tools = None
        conversation = history + body.input_messages()

        def finish(final, c, counted: int) -> dict:
            status, error = _ending(c)
            made = final.metrics.num_generation_tokens if final.metrics is not None else counted
            response = writer.finish(status, response_usage(len(prompt), made), error)
            if body.store and status != "failed":
                store.put(writer.id, response, conversation + [assistant_message(writer.text, writer.function_calls)])
            return response

        if body.stream:
            return StreamingResponse(events(streams[0], writer, tools, finish, ctx.aborter(rid, 1)),
                                     media_type="text/event-stream")
        final = (await finals(request, streams, ctx.aborter(rid, 1)))[0]
        c = final.outputs[0]
        reasoning, text = split_reasoning(parser, c.text) if parser is not None else (None, c.text)
        content, calls = tools.parse(text or "") if tools is not None else (text, [])
        writer.reasoning(reasoning or "")
        writer.content(content or "")
        for i, (name, arguments) in enumerate(calls):
            writer.call(i, new_call_id(), name, arguments)
        return finish(final, c, len(c.token_ids))

    async def events(stream, writer: ResponseWriter, tools, finish, abort):
        """The answer's events as its tokens arrive (each delta read as the chat route reads a streamed answer:
        think block, then tool calls); the request is aborted if the client goes away, and a failed engine ends
        the stream with response.failed."""
        splitter = ThinkSplitter.of(parser) if parser is not None else None
        streamer = tools.streamer() if tools is not None else None
        counted, failed = 0, None
        writer.start()
        yield "".join(writer.take())
        try:
            while not stream.done:
                try:
                    out = stream.take()
                except EngineDead as exc:
                    failed = str(exc)
                    writer.finish("failed", None, {"code": "server_error", "message": failed})
                    yield "".join(writer.take())
                    return
                for c in out.outputs if out is not None else ():
                    ended = c.finish_reason is not None
                    counted += len(c.token_ids)
                    reasoning, text = splitter.feed(c.text, ended) if splitter is not None else ("", c.text)
                    writer.reasoning(reasoning)
                    content, deltas = streamer.feed(text, ended) if streamer is not None else (text, [])
                    writer.content(content)
                    for d in deltas:
                        if "id" in d:
                            writer.call(d["index"], d["id"], d["function"]["name"], d["function"]["arguments"])
                        else:
                            writer.call_arguments(d["index"], d["function"]["arguments"])
                    if ended:
                        finish(out, c, counted)
                chunk = writer.take()
                if chunk:
                    yield "".join(chunk)
                stream.ready.clear()
                if not stream.done and not stream.has_news:
                    await stream.ready.wait()
        finally:
            if not stream.done:              # the client went away (or the engine failed) mid-stream
                abort(failed=failed)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        stored = store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
