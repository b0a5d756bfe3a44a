"""POST /v1/completions: a prompt or a batch of them (strings or token ids), `echo` (the prompt
sent back before its completion, with its log-probabilities when asked) and the legacy
completions `logprobs` layout."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from starlette.requests import Request
from starlette.responses import Response

from tandem.engine.outputs import RequestOutput
from tandem.serving.openai import protocol as P
from tandem.serving.openai import responses as R
from tandem.serving.openai.generation import Collected, GenerationEndpoint, Job


@dataclass
class CompletionJob(Job):
    #: `echo`: each choice's prompt text, sent before its completion.
    echo: list[str] | None = None
    #: `echo` with `max_tokens` 0: the prompt alone, the engine's one sampled token dropped.
    echo_only: bool = False
    #: Streamed choices whose echo is still to be sent.
    echo_pending: set[int] = field(default_factory=set)
    #: Per choice, the `text_offset` of its next token.
    text_offsets: list[int] = field(default_factory=list)


class CompletionEndpoint(GenerationEndpoint):
    endpoint = "/v1/completions"
    id_prefix = "cmpl"
    chunk_builder = R.completion_chunk
    job_type = CompletionJob

    async def handle(self, request: Request) -> Response:
        start = time.perf_counter()
        req: P.CompletionRequest = self.ctx.parse(P.CompletionRequest, await self.ctx.read_json(request))
        req.check_fields()
        prompts = self.prompts(req.prompt)
        _, json_schema = await self.output_constraint(req)
        params = req.sampling_params([len(ids) for ids, _ in prompts], self.ctx.client.max_model_len, json_schema)
        job: CompletionJob = self.new_job(req, [ids for ids, _ in prompts], params, start,
                                          [text for _, text in prompts])
        if req.echo:
            decode = self.ctx.client.tokenizer.decode
            texts = [text if text is not None else decode(ids) for ids, text in prompts]
            job.echo = [text for text in texts for _ in range(len(params))]
            job.echo_only = req.echo_only
            job.echo_pending = set(range(job.n))
        return await self.run(request, job, bool(req.stream))

    def prompts(self, prompt: Any) -> list[tuple[list[int], str | None]]:
        """A prompt, or a batch of them (a list of strings or of token lists), as (ids, text)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return [self.prompt_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        return [self.prompt_ids(prompt, "prompt")]

    def prompt_ids(self, prompt: Any, param: str) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise P.invalid_request("the prompt is empty", param=param)
            ids, text = self.ctx.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
            self.ctx.check_token_ids(ids, param, "prompt token id")
        if not ids:
            raise P.invalid_request("the prompt is empty", param=param)
        return ids, text

    def shape_logprobs(self, job: CompletionJob, i: int, entries: R.TokenLogprobs,
                       prompt_entries: R.TokenLogprobs | None) -> dict[str, Any]:
        """`prompt_entries` (echo): its prompt's, from the second token on, go first."""
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
        body = R.completion_logprobs(entries, self.ctx.token_text, job.text_offsets[i], first_prompt_token)
        job.text_offsets[i] += sum(len(t) for t in body["tokens"])
        return body

    def stream_choices(self, job: CompletionJob, i: int, out: RequestOutput,
                       reason: str | None) -> Iterator[list[dict[str, Any]]]:
        new_logprobs = None if job.echo_only else out.new_logprobs
        prompt_logprobs = out.prompt_logprobs if job.echo else None
        logprobs = (self.logprobs_object(job, i, new_logprobs, prompt_logprobs)
                    if new_logprobs or prompt_logprobs is not None else None)
        text = "" if job.echo_only else out.new_text
        if i in job.echo_pending:
            job.echo_pending.discard(i)
            text = job.echo[i] + text
        if text or logprobs or out.finished:
            yield [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}]

    def start_collecting(self, job: CompletionJob) -> Collected:
        collected = super().start_collecting(job)
        if job.echo:
            collected.texts = list(job.echo)
        return collected

    def gather(self, job: CompletionJob, collected: Collected, i: int, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None and job.echo:
            collected.prompt_logprobs[i] = out.prompt_logprobs
        if not job.echo_only:
            super().gather(job, collected, i, out)

    def response_body(self, job: CompletionJob, collected: Collected, usage: dict[str, Any]) -> dict[str, Any]:
        logprobs = [self.logprobs_object(job, i, collected.logprobs[i], collected.prompt_logprobs[i])
                    for i in range(job.n)]
        return R.completion_response(job.request_id, job.created, job.model,
                                     list(zip(collected.texts, collected.reasons)), usage, logprobs)
