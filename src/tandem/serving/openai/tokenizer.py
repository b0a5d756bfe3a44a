"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages rendered by the
model's chat format first), POST /detokenize and GET /tokenizer_info."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.serving.openai import protocol as P
from tandem.serving.openai.base import ServingContext


class TokenizerEndpoints:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def tokenize(self, request: Request) -> Response:
        data = await self.ctx.read_json(request)
        chat = isinstance(data, dict) and "messages" in data
        req = self.ctx.parse(P.TokenizeChatRequest if chat else P.TokenizeCompletionRequest, data)
        if chat:
            if not req.messages:
                raise P.invalid_request("'messages' must contain at least one message", param="messages")
            text = self.ctx.chat_format.render([m.model_dump(exclude_none=True) for m in req.messages], req)
        else:
            text = req.prompt
        ids = self.ctx.encode(text, add_special_tokens=req.add_special_tokens)
        tokenizer = self.ctx.client.tokenizer
        strs = [tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.ctx.client.max_model_len, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        req = self.ctx.parse(P.DetokenizeRequest, await self.ctx.read_json(request))
        self.ctx.check_token_ids(req.tokens, "tokens", "token id")
        return JSONResponse({"prompt": self.ctx.client.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    async def tokenizer_info(self, request: Request) -> Response:
        ctx = self.ctx
        special = ctx.chat_format.context
        return JSONResponse({
            "tokenizer_class": type(ctx.client.tokenizer).__name__,
            "vocab_size": ctx.vocab_size,
            "model_max_length": ctx.client.max_model_len,
            "bos_token": special["bos_token"] or None,
            "eos_token": special["eos_token"] or None,
            "eos_token_ids": sorted(ctx.client.eos_token_ids),
            "chat_template": ctx.chat_format.template,
        })
