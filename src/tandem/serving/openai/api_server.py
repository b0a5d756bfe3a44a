"""The OpenAI-compatible HTTP app of `tandem serve`.

`create_app(client)` builds a FastAPI app over an `EngineClient`:

  POST /v1/completions, POST /v1/chat/completions   (JSON or `stream: true` Server-Sent Events)
  GET  /v1/models, GET /v1/models/{id}
  GET|HEAD /health, GET|POST /ping                  (open even with an API key)
  GET  /metrics                                     (Prometheus text; open)
  POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /version   (vLLM's; open)

Request bodies are read and validated here rather than by FastAPI, so that every problem is
an OpenAI-shaped error (`protocol.APIError`): 400 for malformed/invalid requests, 401 for a
missing or wrong API key, 404 for an unknown model, 413 for a body over `max_request_bytes`,
429/503 for `EngineOverloadedError`/`EngineUnavailableError`, 429 for a stream over
`max_streams_per_key`, 500 for a failed generation or an unexpected exception (whose message
is not sent, and not logged unless `log_requests`).

`max_streams_per_key` caps the streaming requests open at once per client: per API key (the
bearer token, held only as a hash), or per client address when no key is sent.

The OpenAPI schema (`/openapi.json`, `serving/openai/openapi.py`) documents the request bodies (from
the pydantic models in `protocol`) and the error statuses, so a schema-driven fuzzer exercises
the real parsing. The HTTP plumbing (errors, disconnects, SSE, middlewares) is
`serving/openai/asgi.py`; merging a request's engine requests, `serving/openai/fanout.py`.

A request with `n > 1` fans out to `n` engine requests `<id>-0 ... <id>-<n-1>` (with seeds
`seed + i` when a seed is given). When the client goes away (mid-stream, or while waiting for
a non-streamed answer) the engine generators are closed at once, which aborts the requests in
the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from tandem.worker.sampling import SamplingParams
from tandem.serving.openai import protocol as P
from tandem.serving.openai.asgi import (
    AuthMiddleware,
    ClientGone,
    MetricsMiddleware,
    SSEResponse,
    error_response,
    exception_summary,
    until_disconnect,
)
from tandem.serving.openai.chat_template import ChatTemplateError, compile_template, render_chat
from tandem.serving.engine_client import EngineClient, EngineOverloadedError, EngineUnavailableError
from tandem.serving.openai.fanout import RequestFanout
from tandem.serving.metrics import ServingMetrics
from tandem.serving.openai.openapi import ERROR_RESPONSES, openapi_schema, request_body
from tandem.serving.openai.structured import ToolChoice, parse_tool_choice, parse_tools, response_format_schema
from tandem.serving.openai.tool_parser import TOOL_CALL_START, ToolCallStream, finish_reason, parse_tool_calls
from tandem.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

#: `Retry-After` of every 429 (seconds).
RETRY_AFTER_S = "1"


@dataclass
class _Job:
    chat: bool
    request_id: str
    created: int
    model: str
    #: The prompt of each choice (a batch of prompts times `n`: choice i is prompt i // n).
    prompts: list[list[int]]
    params: list[SamplingParams]
    include_usage: bool
    start: float
    num_prompts: int = 1
    #: vLLM's `continuous_usage_stats`: usage so far in every chunk.
    continuous_usage: bool = False
    prompt_text: str | list[str | None] | None = None  # only kept when logging requests
    # Progress
    first_token_at: float | None = None
    output_tokens: list[int] = field(default_factory=list)
    #: `echo`: each choice's prompt text, sent before its completion.
    echo: list[str] | None = None
    #: `echo` with `max_tokens` 0: the prompt alone, the engine's one sampled token dropped.
    echo_only: bool = False
    #: Per choice, the `text_offset` of its next token (completions logprobs).
    text_offsets: list[int] = field(default_factory=list)
    admitted: set[int] = field(default_factory=set)
    #: Chat replies read for tool calls: the `tool_choice` mode ("auto", "required", "named")
    #: and the named tool; None: the reply is plain content.
    tool_mode: str | None = None
    tool_name: str | None = None

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def n(self) -> int:
        return len(self.params)

    @property
    def num_prompt_tokens(self) -> int:
        """Each distinct prompt counted once, as OpenAI's usage does (not once per choice)."""
        per_prompt = self.n // self.num_prompts
        return sum(len(self.prompts[i * per_prompt]) for i in range(self.num_prompts))


class _Server:
    def __init__(
        self,
        client: EngineClient,
        *,
        served_model_name: str,
        max_request_bytes: int,
        log_requests: bool,
        metrics: ServingMetrics,
        max_streams_per_key: int | None = None,
    ) -> None:
        self.client = client
        self.served = served_model_name
        self.max_request_bytes = max_request_bytes
        self.log_requests = log_requests
        self.max_streams_per_key = max_streams_per_key
        self.open_streams: dict[str, int] = {}
        self.metrics = metrics
        self.created = P.now()
        self.chat_template = getattr(client, "chat_template", None)
        if self.chat_template is not None:
            try:
                compile_template(self.chat_template)
            except Exception as exc:
                raise ValueError(f"the model's chat template does not compile: {exc}") from exc
        self.template_context = self._template_context()
        try:
            self.vocab_size: int | None = int(client.tokenizer.get_vocab_size(with_added_tokens=True))
        except Exception:
            self.vocab_size = None

    def _template_context(self) -> dict[str, str]:
        """`bos_token`/`eos_token` for chat templates: from the client when it has them,
        else the eos token's text from the tokenizer."""
        context = {"bos_token": getattr(self.client, "bos_token", None) or "", "eos_token": ""}
        eos = getattr(self.client, "eos_token", None)
        if not eos and self.client.eos_token_ids:
            try:
                eos = self.client.tokenizer.id_to_token(min(self.client.eos_token_ids))
            except Exception:
                eos = None
        context["eos_token"] = eos or ""
        return context

    # ------------------------------------------------------------------ plumbing

    async def guard(self, request: Request, handler: Callable[[Request], Awaitable[Response]]) -> Response:
        """Run `handler`, turning every failure into an OpenAI-shaped error response."""
        try:
            return await handler(request)
        except P.APIError as err:
            return error_response(err, headers={"Retry-After": RETRY_AFTER_S} if err.status == 429 else None)
        except ChatTemplateError as exc:
            return error_response(P.invalid_request(str(exc), param="messages"))
        except EngineOverloadedError as exc:
            err = P.APIError(429, f"the engine is overloaded: {exc}" if str(exc) else "the engine is overloaded",
                             type="rate_limit_error", code="engine_overloaded")
            return error_response(err, headers={"Retry-After": RETRY_AFTER_S})
        except EngineUnavailableError as exc:
            err = P.APIError(503, f"the engine is unavailable: {exc}" if str(exc) else "the engine is unavailable",
                             type="server_error", code="engine_unavailable")
            return error_response(err)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; recorded in the metrics as such
        except Exception as exc:
            if self.log_requests:
                logger.exception("internal error on %s", request.url.path)
            else:
                logger.error("internal error on %s: %s", request.url.path, exception_summary(exc))
            return error_response(P.APIError(500, "internal server error", type="server_error", code="internal_error"))

    async def read_json(self, request: Request) -> Any:
        limit = self.max_request_bytes
        too_large = P.APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > limit:
                    raise too_large
            except ValueError:
                raise P.invalid_request("invalid Content-Length header") from None
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
        except ClientDisconnect:
            raise ClientGone() from None  # gone while sending its body: a 499, not a 500
        return P.decode_json(bytes(body))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served:
            raise P.APIError(404, f"The model '{model}' does not exist; this server serves '{self.served}'",
                             param="model", code="model_not_found")

    def sampling_params(self, req: P._SamplingRequest, max_tokens: int, max_tokens_param: str,
                        logprobs: int | None = None, prompt_logprobs: int | None = None,
                        json_schema: str | None = None) -> list[SamplingParams]:
        n = 1 if req.n is None else req.n
        if not 1 <= n <= P.MAX_N:
            raise P.invalid_request(f"'n' must be between 1 and {P.MAX_N}, got {n}", param="n")
        if max_tokens < 1:
            raise P.invalid_request(f"'{max_tokens_param}' must be at least 1, got {max_tokens}", param=max_tokens_param)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s == "" for s in stop):
            raise P.invalid_request("'stop' strings must be non-empty", param="stop")
        stop_token_ids = list(req.stop_token_ids or [])
        if any(t < 0 for t in stop_token_ids):
            raise P.invalid_request("'stop_token_ids' must be non-negative token ids", param="stop_token_ids")
        if req.seed is not None and not P.MIN_SEED <= req.seed <= P.MAX_SEED:
            raise P.invalid_request(f"'seed' must be a 64-bit integer in [{P.MIN_SEED}, {P.MAX_SEED}]", param="seed")
        best_of = getattr(req, "best_of", None)
        if best_of is not None and best_of != n:
            # best_of > n ranks candidates by cumulative log-probability; vLLM's V1 engine refuses it too.
            raise P.invalid_request(f"'best_of' must equal 'n' ({n}) on this server, got {best_of}", param="best_of")
        if req.logit_bias:
            raise P.invalid_request("'logit_bias' is not supported by this server", param="logit_bias")
        top_k = 0 if req.top_k in (None, -1) else req.top_k
        params = []
        for i in range(n):
            try:
                params.append(
                    SamplingParams(
                        max_tokens=max_tokens,
                        temperature=1.0 if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p,
                        top_k=top_k,
                        min_p=req.min_p or 0.0,
                        seed=None if req.seed is None else req.seed + i,
                        stop=list(stop),
                        stop_token_ids=list(stop_token_ids),
                        ignore_eos=bool(req.ignore_eos),
                        min_tokens=req.min_tokens or 0,
                        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                        frequency_penalty=req.frequency_penalty or 0.0,
                        presence_penalty=req.presence_penalty or 0.0,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                        json_schema=json_schema,
                    )
                )
            except ValueError as exc:
                name = str(exc).split()[0] if str(exc) else None
                raise P.invalid_request(f"invalid sampling parameter: {exc}", param=name) from None
        return params

    def check_context(self, num_prompt: int, max_tokens: int, prompt_param: str, max_tokens_param: str) -> None:
        limit = self.client.max_model_len
        if num_prompt + max_tokens > limit:
            raise P.invalid_request(
                f"This model's maximum context length is {limit} tokens, but the request needs "
                f"{num_prompt + max_tokens} ({num_prompt} in the prompt + {max_tokens} for '{max_tokens_param}'). "
                f"Shorten the prompt or lower '{max_tokens_param}'.",
                param=prompt_param if num_prompt >= limit else max_tokens_param,
                code="context_length_exceeded",
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.client.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def completion_prompts(self, prompt: Any) -> list[tuple[list[int], str | None]]:
        """A prompt, or a batch of them (a list of strings or of token lists), as (ids, text)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return [self.completion_prompt_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        return [self.completion_prompt_ids(prompt, "prompt")]

    def completion_prompt_ids(self, prompt: Any, param: str) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise P.invalid_request("the prompt is empty", param=param)
            ids = self.encode(prompt)
            text = prompt
        else:
            ids, text = list(prompt), None
            bad = [t for t in ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
            if bad:
                raise P.invalid_request(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})", param=param)
        if not ids:
            raise P.invalid_request("the prompt is empty", param=param)
        return ids, text

    # ------------------------------------------------------------------ endpoints

    def parse(self, model: type[P._SamplingRequest], data: Any) -> Any:
        req = P.parse_request(model, data)
        ignored = P.ignored_fields(req)
        if ignored:
            logger.warning("ignoring unknown request field(s): %s", ", ".join(ignored))
        self.check_model(req.model)
        return req

    async def completions(self, request: Request) -> Response:
        start = time.perf_counter()
        req: P.CompletionRequest = self.parse(P.CompletionRequest, await self.read_json(request))
        req.check_unsupported()
        prompts = self.completion_prompts(req.prompt)
        max_tokens = P.DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        # As vLLM (and OpenAI's legacy API): echo with max_tokens 0 returns the prompt alone
        # (its log-probabilities, lm-eval's loglikelihood request); the engine still samples
        # one token, which is dropped but counted in usage, as vLLM counts it.
        echo_only = bool(req.echo) and max_tokens == 0
        if echo_only:
            max_tokens = 1
        elif max_tokens < 1:
            raise P.invalid_request(f"'max_tokens' must be at least 1, got {max_tokens} (0 only with 'echo': true, "
                                    "which returns the prompt)", param="max_tokens")
        _, json_schema = await self.output_constraint(req)
        params = self.sampling_params(req, max_tokens, "max_tokens", logprobs=req.logprobs,
                                      prompt_logprobs=req.logprobs if req.echo else None, json_schema=json_schema)
        if len(prompts) * len(params) > P.MAX_CHOICES:
            raise P.invalid_request(f"{len(prompts)} prompts x n={len(params)} is more than {P.MAX_CHOICES} choices "
                                    "in one request", param="prompt")
        for i, (prompt_ids, _) in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            self.check_context(len(prompt_ids), max_tokens, where, "max_tokens")
        job = self.new_job(False, req, [ids for ids, _ in prompts], params, start, [text for _, text in prompts])
        if req.echo:
            texts = [text if text is not None else self.client.tokenizer.decode(ids) for ids, text in prompts]
            job.echo = [text for text in texts for _ in range(len(params))]
            job.echo_only = echo_only
        return await self.run(request, job, bool(req.stream))

    async def chat_completions(self, request: Request) -> Response:
        start = time.perf_counter()
        req: P.ChatCompletionRequest = self.parse(P.ChatCompletionRequest, await self.read_json(request))
        req.check_unsupported()
        if req.top_logprobs is not None and not req.logprobs:
            raise P.invalid_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if not req.messages:
            raise P.invalid_request("'messages' must contain at least one message", param="messages")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tool_choice, json_schema = await self.output_constraint(req)
        text = self.render(messages, req)
        # A model's template writes its special tokens itself; the default format does not.
        prompt_ids = self.encode(text, add_special_tokens=self.chat_template is None)
        if not prompt_ids:
            raise P.invalid_request("the rendered chat prompt is empty", param="messages")
        if req.max_completion_tokens is not None:
            max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
        elif req.max_tokens is not None:
            max_tokens, name = req.max_tokens, "max_tokens"
        else:
            max_tokens, name = self.client.max_model_len - len(prompt_ids), "max_tokens"
            if max_tokens < 1:
                self.check_context(len(prompt_ids), 1, "messages", name)
        params = self.sampling_params(req, max_tokens, name, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                      json_schema=json_schema)
        self.check_context(len(prompt_ids), max_tokens, "messages", name)
        job = self.new_job(True, req, [prompt_ids], params, start, text)
        if tool_choice is not None and (tool_choice.mode in ("required", "named")
                                        or (tool_choice.mode == "auto" and self.parses_tool_calls)):
            job.tool_mode, job.tool_name = tool_choice.mode, tool_choice.name
        return await self.run(request, job, bool(req.stream))

    async def output_constraint(self, req: P._SamplingRequest) -> tuple[ToolChoice | None, str | None]:
        """The chat request's tool choice (None: no tools asked about) and the JSON schema the
        reply must match (None: free). Checked on a worker thread: the first check imports
        xgrammar (seconds), and the event loop keeps serving the other requests meanwhile."""
        if req.response_format is None and getattr(req, "tools", None) is None \
                and getattr(req, "tool_choice", None) is None:
            return None, None
        return await asyncio.to_thread(self._output_constraint, req)

    @staticmethod
    def _output_constraint(req: P._SamplingRequest) -> tuple[ToolChoice | None, str | None]:
        response_schema = response_format_schema(req.response_format)
        if not isinstance(req, P.ChatCompletionRequest):
            return None, response_schema
        tool_choice = parse_tool_choice(req.tool_choice, parse_tools(req.tools), req.parallel_tool_calls)
        tool_schema = tool_choice.json_schema()
        if tool_schema is not None and response_schema is not None:
            raise P.invalid_request(f"'response_format' cannot constrain a reply that 'tool_choice' "
                                    f"({tool_choice.mode}) already constrains to a tool call", param="response_format")
        return tool_choice, tool_schema or response_schema

    @property
    def parses_tool_calls(self) -> bool:
        """Whether "auto" replies are read for tool calls: the chat format in use writes them in
        the Hermes format (this server's default format, Qwen-family templates)."""
        return self.chat_template is None or TOOL_CALL_START in self.chat_template

    def render(self, messages: list[dict[str, Any]], req: P.ChatCompletionRequest | P.TokenizeChatRequest) -> str:
        context: dict[str, Any] = dict(self.template_context)
        if req.tools is not None:
            context["tools"] = req.tools
        kwargs = req.chat_template_kwargs or {}
        reserved = sorted({"messages", "template"} & set(kwargs))
        if reserved:
            raise P.invalid_request(f"'chat_template_kwargs' may not set {reserved[0]!r}", param="chat_template_kwargs")
        context.update(kwargs)
        if req.add_generation_prompt is not None:
            context["add_generation_prompt"] = req.add_generation_prompt
        return render_chat(messages, self.chat_template, **context)

    def new_job(self, chat: bool, req: P._SamplingRequest, prompts: list[list[int]], params: list[SamplingParams],
                start: float, prompt_text: str | list[str | None] | None) -> _Job:
        """`prompts`: one or more (a batch), each to be answered with `params` (its n choices)."""
        n = len(params)
        params = [p for _ in prompts for p in params]
        job = _Job(
            chat=chat,
            request_id=P.new_id("chatcmpl" if chat else "cmpl"),
            created=P.now(),
            model=self.served,
            prompts=[prompt for prompt in prompts for _ in range(n)],
            params=params,
            num_prompts=len(prompts),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            continuous_usage=bool(req.stream_options and req.stream_options.include_usage
                                  and req.stream_options.continuous_usage_stats),
            start=start,
            prompt_text=prompt_text if self.log_requests else None,
            output_tokens=[0] * len(params),
        )
        if self.log_requests:
            logger.info("request %s: prompt=%r (%d tokens), params=%s", job.request_id, prompt_text,
                        job.num_prompt_tokens, params[0])
        else:
            logger.debug("request %s: %d prompt tokens, n=%d, max_tokens=%d", job.request_id, job.num_prompt_tokens,
                         len(params), params[0].max_tokens)
        return job

    def token_text(self, token: int) -> str:
        return self.client.tokenizer.decode([token], skip_special_tokens=False)

    def logprobs_object(self, job: _Job, i: int, entries: P.TokenLogprobs | None,
                        prompt_entries: P.TokenLogprobs | None = None) -> dict[str, Any] | None:
        """The logprobs of choice i's new tokens, in the endpoint's shape (None: not asked);
        `prompt_entries` (echo): its prompt's, from the second token on, go first."""
        if job.params[i].logprobs is None:
            return None
        entries = entries or []
        if job.chat:
            return P.chat_logprobs(entries, self.token_text)
        if not job.text_offsets:
            job.text_offsets = [0] * job.n  # echo: the prompt's tokens come first, from offset 0
        first_prompt_token = None
        if prompt_entries is not None:
            prompt = job.prompts[i]
            if len(prompt_entries) != len(prompt) - 1:
                raise P.APIError(500, f"the engine returned {len(prompt_entries)} prompt log-probabilities for a "
                                 f"{len(prompt)}-token prompt (not computed under pipeline parallelism)",
                                 type="server_error", code="generation_error")
            first_prompt_token = prompt[0]
            entries = [*prompt_entries, *entries]
        body = P.completion_logprobs(entries, self.token_text, job.text_offsets[i], first_prompt_token)
        job.text_offsets[i] += sum(len(t) for t in body["tokens"])
        return body

    def account(self, job: _Job, i: int, out: RequestOutput) -> None:
        if i not in job.admitted:
            job.admitted.add(i)
            self.metrics.add_prompt_tokens(len(job.prompts[i]))
        n = len(out.new_token_ids)
        if n:
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
                self.metrics.observe_ttft(job.endpoint, job.first_token_at - job.start)
            job.output_tokens[i] += n
            self.metrics.add_generated_tokens(n)
        if out.finished and out.num_output_tokens > job.output_tokens[i]:
            extra = out.num_output_tokens - job.output_tokens[i]
            job.output_tokens[i] = out.num_output_tokens
            self.metrics.add_generated_tokens(extra)

    def log_done(self, job: _Job, reasons: list[str | None], texts: list[str] | None) -> None:
        if self.log_requests:
            logger.info("request %s done: finish=%s, %s output tokens, outputs=%r", job.request_id, reasons,
                        job.output_tokens, texts)
        else:
            logger.debug("request %s done: finish=%s, %s output tokens", job.request_id, reasons, job.output_tokens)

    @staticmethod
    def stream_owner(request: Request) -> str:
        """Whom a stream counts against: the API key sent (as a hash), else the client address."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()[:32]
        return "addr:" + (request.client.host if request.client else "unknown")

    def open_stream(self, request: Request) -> Callable[[], None]:
        """Count one more open stream for the request's owner (429 over the cap); returns the
        release function, which is safe to call more than once."""
        if self.max_streams_per_key is None:
            return lambda: None
        owner = self.stream_owner(request)
        if self.open_streams.get(owner, 0) >= self.max_streams_per_key:
            raise P.APIError(
                429, f"too many concurrent streams for this API key (at most {self.max_streams_per_key}); "
                "wait for one to finish", type="rate_limit_error", code="too_many_streams",
            )
        self.open_streams[owner] = self.open_streams.get(owner, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self.open_streams.get(owner, 1) - 1
                if left > 0:
                    self.open_streams[owner] = left
                else:
                    self.open_streams.pop(owner, None)

        return release

    async def run(self, request: Request, job: _Job, stream: bool) -> Response:
        release = self.open_stream(request) if stream else (lambda: None)
        per_prompt = job.n // job.num_prompts
        trackers = [tracker for i in range(0, job.n, per_prompt)
                    for tracker in self.metrics.vllm.track_prompt(job.start, job.params[i].max_tokens, per_prompt)]
        fanout = RequestFanout(self.client, job.request_id, job.prompts, job.params, trackers)
        if not stream:
            try:
                body = await until_disconnect(request.receive, self.collect(job, fanout))
            finally:
                await fanout.aclose()
            return JSONResponse(body)
        try:
            await until_disconnect(request.receive, fanout.prime())
        except BaseException:
            release()
            await fanout.aclose()
            raise

        async def on_close() -> None:
            release()
            await fanout.aclose()

        return SSEResponse(self.stream_events(job, fanout), on_close=on_close)

    async def collect(self, job: _Job, fanout: RequestFanout) -> dict[str, Any]:
        texts = list(job.echo) if job.echo else [""] * job.n
        reasons: list[str | None] = [None] * job.n
        logprobs: list[P.TokenLogprobs] = [[] for _ in range(job.n)]
        prompt_logprobs: list[P.TokenLogprobs | None] = [None] * job.n
        async for i, out in fanout.events():
            self.account(job, i, out)
            if out.prompt_logprobs is not None and job.echo:
                prompt_logprobs[i] = out.prompt_logprobs
            if not job.echo_only:
                texts[i] += out.new_text
                logprobs[i] += out.new_logprobs or []
            if out.finished:
                if out.finish_reason == "error":
                    raise P.APIError(500, f"generation failed: {out.error or 'engine error'}", type="server_error",
                                     code="generation_error")
                reasons[i] = out.finish_reason
        self.log_done(job, reasons, texts)
        usage = P.usage(job.num_prompt_tokens, sum(job.output_tokens))
        calls: list[list] = [[] for _ in range(job.n)]
        if job.tool_mode is not None:
            for i in range(job.n):
                content, calls[i] = parse_tool_calls(job.tool_mode, texts[i], job.tool_name)
                texts[i] = content
                reasons[i] = finish_reason(job.tool_mode, reasons[i], len(calls[i]))
        choices = list(zip(texts, reasons))
        build = P.chat_response if job.chat else P.completion_response
        objects = [self.logprobs_object(job, i, logprobs[i], prompt_logprobs[i]) for i in range(job.n)]
        body = build(job.request_id, job.created, job.model, choices, usage, objects)
        for choice, made in zip(body["choices"], calls):
            if made:
                choice["message"]["tool_calls"] = [call.message_item() for call in made]
        return body

    async def stream_events(self, job: _Job, fanout: RequestFanout) -> AsyncIterator[bytes]:
        build = P.chat_chunk if job.chat else P.completion_chunk
        with_usage = job.include_usage

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            if usage is None and job.continuous_usage and choices:
                usage = P.usage(job.num_prompt_tokens, sum(job.output_tokens))
            return P.sse(build(job.request_id, job.created, job.model, choices, usage, with_usage_field=with_usage))

        reasons: list[str | None] = [None] * job.n
        texts = [""] * job.n if self.log_requests else None
        echo_pending = set(range(job.n)) if job.echo else None
        tool_streams = [ToolCallStream(job.tool_mode, job.tool_name) for _ in range(job.n)] if job.tool_mode else None
        try:
            if job.chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                             for i in range(job.n)])
            async for i, out in fanout.events():
                self.account(job, i, out)
                if texts is not None:
                    texts[i] += out.new_text
                if out.finished and out.finish_reason == "error":
                    self.log_done(job, reasons, texts)
                    yield P.sse(P.error_body(f"generation failed: {out.error or 'engine error'}", type="server_error",
                                             code="generation_error"))
                    return
                reason = out.finish_reason if out.finished else None
                if out.finished:
                    reasons[i] = reason
                new_logprobs = None if job.echo_only else out.new_logprobs
                prompt_logprobs = out.prompt_logprobs if job.echo else None
                logprobs = (self.logprobs_object(job, i, new_logprobs, prompt_logprobs)
                            if new_logprobs or prompt_logprobs is not None else None)
                if job.chat and tool_streams is not None:
                    stream = tool_streams[i]
                    deltas = stream.feed(out.new_text) + (stream.finish() if out.finished else [])
                    if logprobs and not deltas:
                        deltas = [{}]  # text held back (a call not yet whole): its logprobs still go now
                    for k, delta in enumerate(deltas):
                        yield chunk([{"index": i, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                      "finish_reason": None}])
                    if out.finished:
                        reason = finish_reason(job.tool_mode, reason, stream.calls)
                        yield chunk([{"index": i, "delta": {}, "finish_reason": reason}])
                    continue
                if job.chat:
                    if out.new_text or logprobs:
                        yield chunk([{"index": i, "delta": {"content": out.new_text}, "logprobs": logprobs,
                                      "finish_reason": None}])
                    if out.finished:
                        yield chunk([{"index": i, "delta": {}, "finish_reason": reason}])
                    continue
                text = "" if job.echo_only else out.new_text
                if echo_pending and i in echo_pending:
                    echo_pending.discard(i)
                    text = job.echo[i] + text
                if text or logprobs or out.finished:
                    yield chunk([{"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}])
            self.log_done(job, reasons, texts)
            if with_usage:
                yield chunk([], P.usage(job.num_prompt_tokens, sum(job.output_tokens)))
            yield P.sse("[DONE]")
        except EngineOverloadedError as exc:
            yield P.sse(P.error_body(f"the engine is overloaded: {exc}", type="rate_limit_error",
                                     code="engine_overloaded"))
        except EngineUnavailableError as exc:
            yield P.sse(P.error_body(f"the engine is unavailable: {exc}", type="server_error",
                                     code="engine_unavailable"))
        except Exception as exc:
            if self.log_requests:
                logger.exception("stream %s failed", job.request_id)
            else:
                logger.error("stream %s failed: %s", job.request_id, exception_summary(exc))
            yield P.sse(P.error_body("internal server error", type="server_error", code="internal_error"))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        self.check_model(model_id)
        return JSONResponse(self.model_card())

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.served,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "max_model_len": self.client.max_model_len,
        }

    async def health(self, request: Request) -> Response:
        try:
            ok, reason = self.client.health()
        except Exception as exc:
            ok, reason = False, f"health check failed: {type(exc).__name__}"
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    async def tokenize(self, request: Request) -> Response:
        data = await self.read_json(request)
        chat = isinstance(data, dict) and "messages" in data
        req = self.parse(P.TokenizeChatRequest if chat else P.TokenizeCompletionRequest, data)
        if chat:
            if not req.messages:
                raise P.invalid_request("'messages' must contain at least one message", param="messages")
            text = self.render([m.model_dump(exclude_none=True) for m in req.messages], req)
        else:
            text = req.prompt
        ids = self.encode(text, add_special_tokens=req.add_special_tokens)
        strs = [self.client.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.client.max_model_len, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        req = self.parse(P.DetokenizeRequest, await self.read_json(request))
        bad = [t for t in req.tokens if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise P.invalid_request(f"token id {bad[0]} is out of range [0, {self.vocab_size})", param="tokens")
        return JSONResponse({"prompt": self.client.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    async def tokenizer_info(self, request: Request) -> Response:
        return JSONResponse({
            "tokenizer_class": type(self.client.tokenizer).__name__,
            "vocab_size": self.vocab_size,
            "model_max_length": self.client.max_model_len,
            "bos_token": self.template_context["bos_token"] or None,
            "eos_token": self.template_context["eos_token"] or None,
            "eos_token_ids": sorted(self.client.eos_token_ids),
            "chat_template": self.chat_template,
        })

    async def metrics_endpoint(self, request: Request) -> Response:
        content, content_type = self.metrics.render()
        return Response(content, headers={"Content-Type": content_type})


def create_app(
    client: EngineClient,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_request_bytes: int = 1_000_000,
    log_requests: bool = False,
    max_streams_per_key: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `client` (see the module docstring)."""
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string (or None for no authentication)")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if max_streams_per_key is not None and max_streams_per_key < 1:
        raise ValueError(f"max_streams_per_key must be >= 1, got {max_streams_per_key}")
    from tandem import __version__ as tandem_version

    served_model_name = served_model_name or client.model_name
    metrics = ServingMetrics(client, model_name=served_model_name)
    server = _Server(
        client,
        served_model_name=served_model_name,
        max_request_bytes=max_request_bytes,
        log_requests=log_requests,
        metrics=metrics,
        max_streams_per_key=max_streams_per_key,
    )
    app = FastAPI(title="tandem", summary="OpenAI-compatible MoE inference server")
    app.state.tandem = server
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(P.validation_error_to_api_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        err = P.APIError(exc.status_code, str(exc.detail), type=kind)
        return error_response(err, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.error("internal error on %s: %s", request.url.path, exception_summary(exc))
        return error_response(P.APIError(500, "internal server error", type="server_error", code="internal_error"))

    @app.post("/v1/completions", openapi_extra=request_body("CompletionRequest"), responses=ERROR_RESPONSES)
    async def completions(request: Request) -> Response:
        return await server.guard(request, server.completions)

    @app.post("/v1/chat/completions", openapi_extra=request_body("ChatCompletionRequest"), responses=ERROR_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        return await server.guard(request, server.chat_completions)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await server.guard(request, server.models)

    model_id_param = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}

    @app.get("/v1/models/{model_id:path}", responses={404: ERROR_RESPONSES[404]}, openapi_extra={"parameters": [model_id_param]})
    async def model(request: Request) -> Response:
        return await server.guard(request, server.model)

    unavailable = {503: {"description": "The engine is unavailable (the reason is in the body)"}}

    @app.api_route("/health", methods=["GET", "HEAD"], responses=unavailable)
    async def health(request: Request) -> Response:
        return await server.health(request)

    @app.api_route("/ping", methods=["GET", "POST"], responses=unavailable)
    async def ping(request: Request) -> Response:
        return await server.health(request)

    @app.get("/version")
    async def version(request: Request) -> Response:
        return JSONResponse({"version": tandem_version})

    @app.post("/tokenize", responses=ERROR_RESPONSES, openapi_extra=request_body("TokenizeRequest"))
    async def tokenize(request: Request) -> Response:
        return await server.guard(request, server.tokenize)

    @app.post("/detokenize", responses=ERROR_RESPONSES, openapi_extra=request_body("DetokenizeRequest"))
    async def detokenize(request: Request) -> Response:
        return await server.guard(request, server.detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        return await server.guard(request, server.tokenizer_info)

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        return await server.metrics_endpoint(request)

    app.openapi = lambda: openapi_schema(app, server.served, server.vocab_size)  # type: ignore[method-assign]
    if api_key is not None:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: also counts 401s
    return app
