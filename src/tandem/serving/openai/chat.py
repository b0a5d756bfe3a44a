"""POST /v1/chat/completions: messages rendered by the model's chat format, `tools` and
`tool_choice` (calls parsed from the reply, or the reply constrained to one), `response_format`,
and the chat `logprobs` layout."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Iterator

from starlette.requests import Request
from starlette.responses import Response

from tandem.engine.outputs import RequestOutput
from tandem.serving.openai import protocol as P
from tandem.serving.openai import responses as R
from tandem.serving.openai.generation import Collected, GenerationEndpoint, Job
from tandem.serving.openai.structured import ToolChoice, parse_tool_choice, parse_tools, response_format_schema
from tandem.serving.openai.tool_parser import ToolCallStream, finish_reason, parse_tool_calls


@dataclass
class ChatJob(Job):
    #: Replies read for tool calls: the `tool_choice` mode ("auto", "required", "named") and the
    #: named tool; None: the reply is plain content.
    tool_mode: str | None = None
    tool_name: str | None = None
    #: Per choice, the tool calls of a streamed reply as they are read.
    tool_streams: list[ToolCallStream] | None = None


class ChatEndpoint(GenerationEndpoint):
    endpoint = "/v1/chat/completions"
    id_prefix = "chatcmpl"
    chunk_builder = R.chat_chunk
    job_type = ChatJob

    async def handle(self, request: Request) -> Response:
        start = time.perf_counter()
        req: P.ChatCompletionRequest = self.ctx.parse(P.ChatCompletionRequest, await self.ctx.read_json(request))
        req.check_fields()
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tool_choice, json_schema = await self.output_constraint(req)
        chat_format = self.ctx.chat_format
        text = chat_format.render(messages, req)
        prompt_ids = self.ctx.encode(text, add_special_tokens=not chat_format.writes_special_tokens)
        if not prompt_ids:
            raise P.invalid_request("the rendered chat prompt is empty", param="messages")
        params = req.sampling_params([len(prompt_ids)], self.ctx.client.max_model_len, json_schema)
        job: ChatJob = self.new_job(req, [prompt_ids], params, start, text)
        if tool_choice is not None and (tool_choice.mode in ("required", "named")
                                        or (tool_choice.mode == "auto" and chat_format.parses_tool_calls)):
            job.tool_mode, job.tool_name = tool_choice.mode, tool_choice.name
            job.tool_streams = [ToolCallStream(job.tool_mode, job.tool_name) for _ in range(job.n)]
        return await self.run(request, job, bool(req.stream))

    async def output_constraint(self, req: P.ChatCompletionRequest) -> tuple[ToolChoice | None, str | None]:
        if req.response_format is None and req.tools is None and req.tool_choice is None:
            return None, None
        return await asyncio.to_thread(self._output_constraint, req)

    @staticmethod
    def _output_constraint(req: P.ChatCompletionRequest) -> tuple[ToolChoice, str | None]:
        response_schema = response_format_schema(req.response_format)
        tool_choice = parse_tool_choice(req.tool_choice, parse_tools(req.tools), req.parallel_tool_calls)
        tool_schema = tool_choice.json_schema()
        if tool_schema is not None and response_schema is not None:
            raise P.invalid_request(f"'response_format' cannot constrain a reply that 'tool_choice' "
                                    f"({tool_choice.mode}) already constrains to a tool call", param="response_format")
        return tool_choice, tool_schema or response_schema

    def shape_logprobs(self, job: Job, i: int, entries: R.TokenLogprobs,
                       prompt_entries: R.TokenLogprobs | None) -> dict[str, Any]:
        return R.chat_logprobs(entries, self.ctx.token_text)

    def opening_choices(self, job: Job) -> list[list[dict[str, Any]]]:
        return [[{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                 for i in range(job.n)]]

    def stream_choices(self, job: ChatJob, i: int, out: RequestOutput,
                       reason: str | None) -> Iterator[list[dict[str, Any]]]:
        logprobs = self.logprobs_object(job, i, out.new_logprobs) if out.new_logprobs else None
        if job.tool_streams is None:
            if out.new_text or logprobs:
                yield [{"index": i, "delta": {"content": out.new_text}, "logprobs": logprobs, "finish_reason": None}]
            if out.finished:
                yield [{"index": i, "delta": {}, "finish_reason": reason}]
            return
        stream = job.tool_streams[i]
        deltas = stream.feed(out.new_text) + (stream.finish() if out.finished else [])
        if logprobs and not deltas:
            deltas = [{}]  # text held back (a call not yet whole): its logprobs still go now
        for k, delta in enumerate(deltas):
            yield [{"index": i, "delta": delta, "logprobs": logprobs if k == 0 else None, "finish_reason": None}]
        if out.finished:
            yield [{"index": i, "delta": {}, "finish_reason": finish_reason(job.tool_mode, reason, stream.calls)}]

    def response_body(self, job: ChatJob, collected: Collected, usage: dict[str, Any]) -> dict[str, Any]:
        texts, reasons = collected.texts, collected.reasons
        calls: list[list] = [[] for _ in range(job.n)]
        if job.tool_mode is not None:
            for i in range(job.n):
                texts[i], calls[i] = parse_tool_calls(job.tool_mode, texts[i], job.tool_name)
                reasons[i] = finish_reason(job.tool_mode, reasons[i], len(calls[i]))
        logprobs = [self.logprobs_object(job, i, collected.logprobs[i]) for i in range(job.n)]
        body = R.chat_response(job.request_id, job.created, job.model, list(zip(texts, reasons)), usage, logprobs)
        for choice, made in zip(body["choices"], calls):
            if made:
                choice["message"]["tool_calls"] = [call.message_item() for call in made]
        return body
