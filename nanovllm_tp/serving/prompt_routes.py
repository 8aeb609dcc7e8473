"""The routes of the OpenAI API (and vLLM's) that read prompts without generating: POST /v1/embeddings (one
embedding per input, from the base model), POST /tokenize (a prompt or a chat) and POST /detokenize."""
from fastapi import Request

from nanovllm_tp.serving.delivery import finals
from nanovllm_tp.serving.embeddings import EmbeddingRequest, embedding_response
from nanovllm_tp.serving.limits import check_prompt_count
from nanovllm_tp.serving.responses import ApiError
from nanovllm_tp.serving.route_context import RouteContext, client_of
from nanovllm_tp.serving.tokenization import (DetokenizeRequest, TokenizeChatRequest, TokenizeRequest,
                                              tokenize_response)


def add_prompt_routes(app, ctx: RouteContext) -> None:
    config, encoder, engine, model = ctx.config, ctx.encoder, ctx.engine, ctx.model
    model_name, tokenizer = model.name, model.tokenizer

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        if ctx.check_model(body.model) is not None:
            raise ApiError(400, f"embeddings come from the base model ({model_name!r}), not from a LoRA adapter")
        try:
            params, prompts = body.pooling_params(), body.prompts()
            check_prompt_count(config, len(prompts))
            encoded = await encoder.completions(prompts, params, client=client_of(request))
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        rid = engine.new_request_id("embd")
        streams = await ctx.submit_all(rid, [ids for _, ids in encoded], params, body.priority, None, request,
                                       [text for text, _ in encoded])
        outputs = await finals(request, streams, ctx.aborter(rid, len(streams)))
        return embedding_response(outputs, model_name, body.encoding_format)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        ctx.check_model(body.model)
        client = client_of(request)
        try:
            if isinstance(body, TokenizeChatRequest):
                ctx.check_template_kwargs(body.chat_template_kwargs)
                ids = await encoder.chat([m.as_template_message() for m in body.messages], body.add_generation_prompt,
                                         body.chat_template_kwargs, client=client, output_room=0,
                                         add_special_tokens=body.add_special_tokens)
            else:
                [(_, ids)] = await encoder.completions([body.prompt], client=client, output_room=0,
                                                       add_special_tokens=body.add_special_tokens)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        except Exception as exc:          # the template's own errors
            raise ApiError(400, f"the chat template failed on these messages: {exc}") from None
        return tokenize_response(ids, tokenizer, model.max_model_len, body.return_token_strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        ctx.check_model(body.model)
        try:
            return {"prompt": await encoder.detokenize(body.tokens, client_of(request))}
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc), param="tokens") from None
