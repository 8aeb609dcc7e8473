"""The generating routes of the OpenAI API: POST /v1/completions (prompts, echo, logprobs with prompt logprobs)
and POST /v1/chat/completions (chat templates, tools and tool_choice, a reasoning parser's think blocks), each
answered whole or streamed."""
from fastapi import Request

from nanovllm_tp.serving.chat_request import ChatCompletionRequest
from nanovllm_tp.serving.completion_request import CompletionRequest
from nanovllm_tp.serving.delivery import finals, stream
from nanovllm_tp.serving.limits import check_request
from nanovllm_tp.serving.reasoning import ThinkSplitter, split_reasoning
from nanovllm_tp.serving.responses import ApiError, ResponseBuilder, chat_logprobs, completion_logprobs
from nanovllm_tp.serving.route_context import RouteContext, client_of
from nanovllm_tp.serving.tool_calls import new_call_id


def add_generate_routes(app, ctx: RouteContext) -> None:
    config, encoder, engine = ctx.config, ctx.encoder, ctx.engine
    model_name, tokenizer = ctx.model.name, ctx.model.tokenizer

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        lora = ctx.check_model(body.model)
        try:
            params, prompts = body.sampling_params(ctx.model.sampling_defaults), body.prompts()
            check_request(config, params, len(prompts))
            encoded = await encoder.completions(prompts, client=client_of(request))
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        rid = engine.new_request_id("cmpl")
        streams = await ctx.submit_all(rid, [ids for _, ids in encoded], params, body.priority, lora, request,
                                       [text for text, _ in encoded])
        builder = ResponseBuilder("completion", rid, lora[0] if lora else model_name, params.n)
        top_n = body.logprobs or 0

        def choice(i, out, c, sent):
            text = encoded[i][0]
            prefix = (text if text is not None else tokenizer.decode(out.prompt_token_ids)) \
                if body.echo and not sent else ""
            lp = None
            if body.logprobs is not None:
                ids, positions = c.token_ids, c.logprobs or []
                if body.echo and not sent and out.prompt_logprobs is not None:
                    ids, positions = out.prompt_token_ids + ids, out.prompt_logprobs + positions
                lp = completion_logprobs(ids, positions, 0, top_n)
            return builder.choice(i, c, prefix, lp, delta=body.stream)

        if body.stream:
            return stream(streams, builder, body.include_usage, choice, ctx.aborter(rid, len(streams)))
        outputs = await finals(request, streams, ctx.aborter(rid, len(streams)))
        return builder.response([choice(i, o, c, False) for i, o in enumerate(outputs) for c in o.outputs], outputs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        lora = ctx.check_model(body.model)
        ctx.check_template_kwargs(body.chat_template_kwargs)
        try:
            tools = ctx.tool_mode(body)
            params = body.sampling_params(tools, ctx.model.sampling_defaults)
            check_request(config, params)
            prompt = await encoder.chat([m.as_template_message() for m in body.messages],
                                        body.add_generation_prompt, body.chat_template_kwargs, body.template_tools(),
                                        client=client_of(request))
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        except Exception as exc:          # the template's own errors (jinja raises its own types)
            raise ApiError(400, f"the chat template failed on these messages: {exc}") from None
        rid = engine.new_request_id("chatcmpl")
        streams = await ctx.submit_all(rid, [prompt], params, body.priority, lora, request)
        builder = ResponseBuilder("chat", rid, lora[0] if lora else model_name, params.n)
        top_n = body.top_logprobs or 0
        streamers, splitters = {}, {}   # choice -> its ToolStreamer / ThinkSplitter (streams with tools / reasoning)

        def choice(i, out, c, sent):
            lp = chat_logprobs(c.token_ids, c.logprobs or [], top_n) if body.logprobs else None
            reasoning, text = reasoning_parts(i, c)
            return builder.choice(i, c, logprobs=lp, delta=body.stream, first=not sent, tools=tool_parts(i, c, text),
                                  text=text, reasoning=reasoning)

        def reasoning_parts(i, c) -> tuple[str | None, str]:
            """(reasoning, content) of the answer (so far, streamed); (None, its text) without a reasoning parser."""
            if config.reasoning_parser is None:
                return None, c.text
            if not body.stream:
                reasoning, content = split_reasoning(config.reasoning_parser, c.text)
                return reasoning, content or ""
            splitter = splitters.setdefault((i, c.index), ThinkSplitter.of(config.reasoning_parser))
            return splitter.feed(c.text, c.finish_reason is not None)

        def tool_parts(i, c, text: str) -> tuple | None:
            """(content, tool_calls, whether it made calls) of the answer's content so far, or None without tools to
            read."""
            if tools is None or tools.choice == "none":
                return None
            if not body.stream:
                content, calls = tools.parse(text)
                return content, [{"id": new_call_id(), "type": "function",
                                  "function": {"name": name, "arguments": args}} for name, args in calls], bool(calls)
            streamer = streamers.setdefault((i, c.index), tools.streamer())
            return *streamer.feed(text, c.finish_reason is not None), streamer.called

        if body.stream:
            return stream(streams, builder, body.include_usage, choice, ctx.aborter(rid, 1))
        outputs = await finals(request, streams, ctx.aborter(rid, 1))
        return builder.response([choice(i, o, c, True) for i, o in enumerate(outputs) for c in o.outputs], outputs)
