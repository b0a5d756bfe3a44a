"""guidellm against a real `tandem serve`: a short sweep (synchronous, throughput and one
constant rate, eight streamed completions each, 32 prompt tokens in, 16 out) with its own
synthetic data from tiny-moe's tokenizer. It sends vLLM's extensions (`ignore_eos`,
`stream_options.continuous_usage_stats`), so every request must succeed with exactly the
tokens asked for, and its JSON report must hold real, non-zero TTFT and inter-token latency."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support.clients import MODEL, client_env, client_executable

pytestmark = pytest.mark.clients

REQUESTS = 8
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16


def test_guidellm_sweep_measures_streamed_latencies(server, tokenizer_dir, tmp_path):
    report = tmp_path / "guidellm.json"
    cmd = [str(client_executable(".venv-guidellm", "guidellm")), "run",
           "--backend", f"kind=openai_http,target={server.base},model={MODEL},request_format=/v1/completions",
           "--profile", "kind=sweep,sweep_size=3",
           "--constraint", f"kind=max_requests,count={REQUESTS}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    done = subprocess.run(cmd, cwd=tmp_path, env=client_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"guidellm failed ({done.returncode}):\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert [b["config"]["strategy"]["type_"] for b in benchmarks] == ["synchronous", "throughput", "constant"]
    for benchmark in benchmarks:
        metrics = benchmark["metrics"]
        assert metrics["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
        # Token counts come from the server's streamed usage (continuous_usage_stats).
        assert metrics["output_token_count"]["successful"]["total_sum"] == REQUESTS * OUTPUT_TOKENS
        assert metrics["prompt_token_count"]["successful"]["total_sum"] == REQUESTS * PROMPT_TOKENS
        ttft = metrics["time_to_first_token_ms"]["successful"]
        itl = metrics["inter_token_latency_ms"]["successful"]
        assert ttft["count"] == REQUESTS and ttft["min"] > 0
        # Streamed token by token: an inter-token gap per token after the first.
        assert itl["count"] == REQUESTS * (OUTPUT_TOKENS - 1) and itl["mean"] > 0
