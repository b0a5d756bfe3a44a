"""The request jobs of the generating endpoints (completions, chat): one `Job` per HTTP request,
run over a `RequestFanout`, answered whole (`collect`) or streamed as Server-Sent Events
(`stream_events`). The endpoint subclasses say how an output becomes their choices.

A request with `n > 1` fans out to `n` engine requests `<id>-0 ... <id>-<n-1>` (with seeds
`seed + i` when a seed is given). When the client goes away (mid-stream, or while waiting for
a non-streamed answer) the engine generators are closed at once, which aborts the requests in
the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.engine.outputs import RequestOutput
from tandem.serving.engine_client import EngineOverloadedError, EngineUnavailableError
from tandem.serving.openai import protocol as P
from tandem.serving.openai import responses as R
from tandem.serving.openai.asgi import SSEResponse, exception_summary, until_disconnect
from tandem.serving.openai.base import ServingContext
from tandem.serving.openai.fanout import RequestFanout
from tandem.serving.openai.structured import response_format_schema
from tandem.worker.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Job:
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
    # Progress
    first_token_at: float | None = None
    output_tokens: list[int] = field(default_factory=list)
    admitted: set[int] = field(default_factory=set)

    @property
    def n(self) -> int:
        return len(self.params)

    @property
    def num_prompt_tokens(self) -> int:
        """Each distinct prompt counted once, as OpenAI's usage does (not once per choice)."""
        per_prompt = self.n // self.num_prompts
        return sum(len(self.prompts[i * per_prompt]) for i in range(self.num_prompts))


@dataclass
class Collected:
    """A non-streamed request's choices, gathered output by output."""

    texts: list[str]
    reasons: list[str | None]
    logprobs: list[R.TokenLogprobs]
    prompt_logprobs: list[R.TokenLogprobs | None]


class GenerationEndpoint:
    """The lifecycle of a generating request; subclasses shape its choices."""

    #: The route, as the metrics label it.
    endpoint = ""
    #: The prefix of the response `id`.
    id_prefix = ""
    #: The stream chunk builder (`responses.completion_chunk` or `chat_chunk`).
    chunk_builder: Callable[..., dict[str, Any]]
    job_type: type[Job] = Job

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    # ------------------------------------------------------------------ endpoint hooks

    def shape_logprobs(self, job: Job, i: int, entries: R.TokenLogprobs,
                       prompt_entries: R.TokenLogprobs | None) -> dict[str, Any]:
        """Choice i's log-probabilities in the endpoint's layout."""
        raise NotImplementedError

    def opening_choices(self, job: Job) -> list[list[dict[str, Any]]]:
        """The chunks (their `choices`) a stream starts with, before any output."""
        return []

    def stream_choices(self, job: Job, i: int, out: RequestOutput, reason: str | None) -> Iterator[list[dict[str, Any]]]:
        """The chunks (their `choices`) one output of choice i streams as."""
        raise NotImplementedError

    def start_collecting(self, job: Job) -> Collected:
        n = job.n
        return Collected([""] * n, [None] * n, [[] for _ in range(n)], [None] * n)

    def gather(self, job: Job, collected: Collected, i: int, out: RequestOutput) -> None:
        """Add one output of choice i to a non-streamed answer."""
        collected.texts[i] += out.new_text
        collected.logprobs[i] += out.new_logprobs or []

    def response_body(self, job: Job, collected: Collected, usage: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    async def output_constraint(self, req: P._SamplingRequest) -> tuple[Any, str | None]:
        """The tool choice (None: no tools asked about; chat only) and the JSON schema the reply
        must match (None: free). Checked on a worker thread: the first check imports xgrammar
        (seconds), and the event loop keeps serving the other requests meanwhile."""
        if req.response_format is None:
            return None, None
        return None, await asyncio.to_thread(response_format_schema, req.response_format)

    # ------------------------------------------------------------------ jobs

    def new_job(self, req: P._SamplingRequest, prompts: list[list[int]], params: list[SamplingParams],
                start: float, prompt_text: str | list[str | None] | None) -> Job:
        """`prompts`: one or more (a batch), each to be answered with `params` (its n choices)."""
        if params and params[0].logit_bias:
            self.ctx.check_token_ids(sorted(params[0].logit_bias), "logit_bias", "logit_bias token id")
        n = len(params)
        params = [p for _ in prompts for p in params]
        options = req.stream_options
        job = self.job_type(
            request_id=R.new_id(self.id_prefix),
            created=R.now(),
            model=self.ctx.served,
            prompts=[prompt for prompt in prompts for _ in range(n)],
            params=params,
            num_prompts=len(prompts),
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.include_usage and options.continuous_usage_stats),
            start=start,
            output_tokens=[0] * len(params),
        )
        if self.ctx.log_requests:
            logger.info("request %s: prompt=%r (%d tokens), params=%s", job.request_id, prompt_text,
                        job.num_prompt_tokens, params[0])
        else:
            logger.debug("request %s: %d prompt tokens, n=%d, max_tokens=%d", job.request_id, job.num_prompt_tokens,
                         len(params), params[0].max_tokens)
        return job

    def logprobs_object(self, job: Job, i: int, entries: R.TokenLogprobs | None,
                        prompt_entries: R.TokenLogprobs | None = None) -> dict[str, Any] | None:
        """The logprobs of choice i's new tokens (None: not asked for)."""
        if job.params[i].logprobs is None:
            return None
        return self.shape_logprobs(job, i, entries or [], prompt_entries)

    def account(self, job: Job, i: int, out: RequestOutput) -> None:
        metrics = self.ctx.metrics
        if i not in job.admitted:
            job.admitted.add(i)
            metrics.add_prompt_tokens(len(job.prompts[i]))
        n = len(out.new_token_ids)
        if n:
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
                metrics.observe_ttft(self.endpoint, job.first_token_at - job.start)
            job.output_tokens[i] += n
            metrics.add_generated_tokens(n)
        if out.finished and out.num_output_tokens > job.output_tokens[i]:
            extra = out.num_output_tokens - job.output_tokens[i]
            job.output_tokens[i] = out.num_output_tokens
            metrics.add_generated_tokens(extra)

    def log_done(self, job: Job, reasons: list[str | None], texts: list[str] | None) -> None:
        if self.ctx.log_requests:
            logger.info("request %s done: finish=%s, %s output tokens, outputs=%r", job.request_id, reasons,
                        job.output_tokens, texts)
        else:
            logger.debug("request %s done: finish=%s, %s output tokens", job.request_id, reasons, job.output_tokens)

    def usage(self, job: Job) -> dict[str, Any]:
        return R.usage(job.num_prompt_tokens, sum(job.output_tokens))

    # ------------------------------------------------------------------ answering

    async def run(self, request: Request, job: Job, stream: bool) -> Response:
        release = self.ctx.open_stream(request) if stream else (lambda: None)
        per_prompt = job.n // job.num_prompts
        trackers = [tracker for i in range(0, job.n, per_prompt)
                    for tracker in self.ctx.metrics.vllm.track_prompt(job.start, job.params[i].max_tokens, per_prompt)]
        fanout = RequestFanout(self.ctx.client, job.request_id, job.prompts, job.params, trackers)
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

    async def collect(self, job: Job, fanout: RequestFanout) -> dict[str, Any]:
        collected = self.start_collecting(job)
        async for i, out in fanout.events():
            self.account(job, i, out)
            self.gather(job, collected, i, out)
            if out.finished:
                if out.finish_reason == "error":
                    raise P.APIError(500, f"generation failed: {out.error or 'engine error'}", type="server_error",
                                     code="generation_error")
                collected.reasons[i] = out.finish_reason
        self.log_done(job, collected.reasons, collected.texts)
        return self.response_body(job, collected, self.usage(job))

    async def stream_events(self, job: Job, fanout: RequestFanout) -> AsyncIterator[bytes]:
        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            if usage is None and job.continuous_usage and choices:
                usage = self.usage(job)
            return R.sse(self.chunk_builder(job.request_id, job.created, job.model, choices, usage,
                                            with_usage_field=job.include_usage))

        reasons: list[str | None] = [None] * job.n
        texts = [""] * job.n if self.ctx.log_requests else None
        try:
            for choices in self.opening_choices(job):
                yield chunk(choices)
            async for i, out in fanout.events():
                self.account(job, i, out)
                if texts is not None:
                    texts[i] += out.new_text
                if out.finished and out.finish_reason == "error":
                    self.log_done(job, reasons, texts)
                    yield R.sse(P.error_body(f"generation failed: {out.error or 'engine error'}", type="server_error",
                                             code="generation_error"))
                    return
                reason = out.finish_reason if out.finished else None
                if out.finished:
                    reasons[i] = reason
                for choices in self.stream_choices(job, i, out, reason):
                    yield chunk(choices)
            self.log_done(job, reasons, texts)
            if job.include_usage:
                yield chunk([], self.usage(job))
            yield R.sse("[DONE]")
        except EngineOverloadedError as exc:
            yield R.sse(P.error_body(f"the engine is overloaded: {exc}", type="rate_limit_error",
                                     code="engine_overloaded"))
        except EngineUnavailableError as exc:
            yield R.sse(P.error_body(f"the engine is unavailable: {exc}", type="server_error",
                                     code="engine_unavailable"))
        except Exception as exc:
            if self.ctx.log_requests:
                logger.exception("stream %s failed", job.request_id)
            else:
                logger.error("stream %s failed: %s", job.request_id, exception_summary(exc))
            yield R.sse(P.error_body("internal server error", type="server_error", code="internal_error"))
