"""`tandem serve --pipeline-parallel-size 2` as a real subprocess: the official openai client
streams the one-process greedy completion, /metrics shows each stage's idle fraction, and
killing the second stage gives a 503 naming that stage within seconds and leaves no process
behind."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from tandem.models.tiny_moe import build_tiny_moe
from tandem.config import SchedulerConfig
from tandem.engine.core import Engine
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampling import SamplingParams
from tandem.testing.server_process import Server, complete, stop_and_check_no_orphans, wait_unhealthy

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

PROMPT = "Stages pass hidden states"


def _one_process_text(max_tokens: int) -> str:
    info = build_tiny_moe()
    engine = Engine(ModelRunner(info), SchedulerConfig(overlap_schedule=False))
    engine.add_request("r", info.tokenizer.encode(PROMPT).ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    text = ""
    while engine.has_work:
        text += "".join(out.new_text for out in engine.step())
    return text


def test_openai_client_streams_from_a_two_stage_pipeline_and_a_killed_stage_is_named():
    import openai

    with Server("tiny-moe", "--pipeline-parallel-size", "2", "--pp-async-batch-depth", "1", "--step-timeout", "20") as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=60, max_retries=0)
        stream = client.completions.create(
            model="tiny-moe", prompt=PROMPT, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        # At start-up the server says whether the pipeline can beat one process, and why.
        assert re.search(r"pipeline parallelism (will not pay|pays) .*decode streams at start-up: [0-9]+ micro-batches in flight [0-9]+ tok/s", server.output())
        pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
        assert len(pieces) > 1
        assert "".join(pieces) == _one_process_text(12)

        deadline = time.monotonic() + 10
        while "tandem_engine_pipeline_stage_idle_ratio" not in (metrics := httpx.get(f"{server.base}/metrics").text):
            assert time.monotonic() < deadline, "no pipeline idle gauge in /metrics"
            time.sleep(0.2)
        assert re.search(r'tandem_engine_pipeline_stage_idle_ratio\{stage="1"\} [0-9.e+-]+', metrics)

        pids = {int(r): int(p) for r, p in re.findall(r"rank (\d+) \(pipeline stage \d+, dp rank \d+\) pid (\d+)", server.output())}
        assert sorted(pids) == [0, 1]
        os.kill(pids[1], signal.SIGKILL)
        health, noticed = wait_unhealthy(server, 30)
        assert health.status_code == 503
        assert "pipeline stage 1" in health.json()["reason"] and "SIGKILL" in health.json()["reason"]
        print(f"stage 1 SIGKILLed: /health 503 after {noticed:.2f} s")
        stop_and_check_no_orphans(server)


def test_a_failing_stage_fails_its_requests_and_a_hung_stage_is_bounded_by_the_step_timeout():
    # tiny-moe's layer 2 runs on stage 1 (rank 1). Its forward of micro-batch 3 raises (warm-up
    # ran 1 and 2); from micro-batch 5 on it hangs.
    env = {"TANDEM_FAULT_INJECT": "kind=raise,layer=2,rank=1,step=3;kind=sleep,layer=2,rank=1,step=5,seconds=120"}
    step_timeout = 4
    with Server("tiny-moe", "--pipeline-parallel-size", "2", "--step-timeout", str(step_timeout), env=env) as server:
        failed = complete(server, "hi", 2)
        assert failed.status_code == 500
        assert "stage 1: InjectedFault" in failed.json()["error"]["message"]
        assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
        # Idle for longer than the step timeout: heartbeats keep stage 1's bounded wait alive.
        time.sleep(step_timeout + 2)
        assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200

        started = time.monotonic()
        hung = complete(server, "hi", 4)  # micro-batch 4 prefills, 5 hangs
        assert hung.status_code in (500, 503)
        health, _ = wait_unhealthy(server, 30)
        elapsed = time.monotonic() - started
        print(f"hung stage 1: answered {hung.status_code}, engine unavailable after {elapsed:.2f} s")
        assert elapsed < step_timeout + 15
        assert health.status_code == 503 and "pipeline stage 1" in health.json()["reason"]
        stop_and_check_no_orphans(server)
