"""`FakeEngine`: a faithful in-memory `EngineClient` that the OpenAI app tests serve."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from tandem.engine.counters import RankCounters
from tandem.engine.outputs import RequestOutput
from tandem.models.tiny_moe import EOS_ID, build_tokenizer
from tandem.serving.engine_client import EngineClient, EngineStats
from tandem.worker.sampling import SamplingParams

MODEL = "tiny-fake"
MAX_MODEL_LEN = 128
PHRASE = "the quick brown fox jumps over the lazy dog. "


class FakeEngine(EngineClient):
    """A faithful in-memory `EngineClient`: the output is `PHRASE` cycled from an offset derived
    from the prompt and seed, one byte token at a time; honours max_tokens, stop strings (held
    back until they cannot start a match), stop_token_ids; records starts and aborts."""

    def __init__(self) -> None:
        self.model_name = MODEL
        self.max_model_len = MAX_MODEL_LEN
        self.tokenizer = build_tokenizer()
        self.eos_token_ids = {EOS_ID}
        self.chat_template = None
        self.reset()

    def reset(self) -> None:
        self.raise_on_generate: type[Exception] | Exception | None = None
        self.error_after: int | None = None
        self.token_delay = 0.0
        self.healthy = (True, "ok")
        self.started: list[str] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.steps = 0

    @staticmethod
    def reference_text(prompt_ids: list[int], seed: int | None, num_tokens: int) -> str:
        offset = (sum(prompt_ids) + (seed or 0)) % len(PHRASE)
        return "".join(PHRASE[(offset + k) % len(PHRASE)] for k in range(num_tokens))

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self.raise_on_generate is not None:
            raise self.raise_on_generate
        self.started.append(request_id)
        self.requests[request_id] = (list(prompt_ids), params)
        full = self.reference_text(prompt_ids, params.seed, params.max_tokens)
        longest_stop = max((len(s) for s in params.stop), default=0)
        text, emitted, count, done = "", 0, 0, False

        def out(ids: list[int], new_text: str, reason: str | None = None, error: str | None = None) -> RequestOutput:
            return RequestOutput(request_id, ids, new_text, finished=reason is not None, finish_reason=reason,
                                 num_prompt_tokens=len(prompt_ids), num_output_tokens=count, error=error)

        try:
            for k, char in enumerate(full):
                await asyncio.sleep(self.token_delay)
                self.steps += 1
                if self.error_after is not None and k >= self.error_after:
                    done = True
                    yield out([], "", "error", error="simulated engine failure")
                    return
                token = ord(char)
                count += 1
                if token in params.stop_token_ids:
                    done = True
                    yield out([token], "", "stop")
                    return
                text += char
                hits = [text.find(s) for s in params.stop if s in text]
                if hits:
                    done = True
                    yield out([token], text[emitted:min(hits)], "stop")
                    return
                safe = len(text) - max(longest_stop - 1, 0)
                if k == len(full) - 1:
                    done = True
                    yield out([token], text[emitted:], "length")
                    return
                new_text = text[emitted:safe] if safe > emitted else ""
                emitted = max(emitted, safe)
                yield out([token], new_text)
        finally:
            (self.finished if done else self.aborted).append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def health(self) -> tuple[bool, str]:
        return self.healthy

    def stats(self) -> EngineStats:
        running = len(set(self.started) - set(self.finished) - set(self.aborted))
        return EngineStats(total=RankCounters(waiting=0, running=running, kv_usage=0.25, steps=self.steps,
                                              ubatched_steps=self.steps // 2, ubatch_yields=self.steps,
                                              step_time_s=0.001 * self.steps))

    async def shutdown(self) -> None:
        pass
