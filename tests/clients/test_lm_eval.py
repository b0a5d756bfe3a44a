"""lm-eval's `local-completions` model against a real `tandem serve`: a loglikelihood
(multiple-choice) task and a generate_until task from local YAML + JSONL (tests/clients/data),
four requests a batch. lm-eval's numbers must be the server's own: each choice's
log-likelihood equals the sum of the echoed continuation's token log-probabilities, and each
generation equals the server's greedy completion."""

from __future__ import annotations

import json
import math
import subprocess

import openai
import pytest

from tests.support.clients import DATA, MODEL, client_env, client_executable

pytestmark = pytest.mark.clients


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def lm_eval_run(server, tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm-eval")
    model_args = ",".join([
        f"base_url={server.url}/completions", f"model={MODEL}", f"tokenizer={tokenizer_dir}",
        "tokenizer_backend=huggingface", "num_concurrent=1", "max_retries=1",
    ])
    cmd = [str(client_executable(".venv-lmeval", "lm_eval")), "--model", "local-completions",
           "--model_args", model_args, "--tasks", "tandem_tiny_choice,tandem_tiny_generate",
           "--include_path", str(DATA), "--batch_size", "4", "--output_path", str(out), "--log_samples"]
    # The tasks' data_files are relative to the data directory.
    done = subprocess.run(cmd, cwd=DATA, env=client_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"lm_eval failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {task: _read_jsonl(next(out.rglob(f"samples_{task}_*.jsonl")))
               for task in ("tandem_tiny_choice", "tandem_tiny_generate")}
    return results, samples


def test_loglikelihood_task_scores_choices_as_the_server_does(lm_eval_run, server):
    results, samples = lm_eval_run
    docs = _read_jsonl(DATA / "tiny_choice.jsonl")
    assert 0.0 <= results["results"]["tandem_tiny_choice"]["acc,none"] <= 1.0
    assert len(samples["tandem_tiny_choice"]) == len(docs)
    oai = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    for sample in samples["tandem_tiny_choice"]:
        assert len(sample["resps"]) == len(sample["doc"]["choices"])
        for k, resp in enumerate(sample["resps"]):
            loglikelihood = float(resp[0][0])
            request = sample["arguments"][f"gen_args_{k}"]
            context, continuation = request["arg_0"], request["arg_1"]
            assert continuation == " " + sample["doc"]["choices"][k]  # lm-eval's target delimiter
            echoed = oai.completions.create(model=MODEL, prompt=context + continuation, max_tokens=0, logprobs=1,
                                            echo=True).choices[0].logprobs
            # The byte tokenizer: the continuation is the prompt's last len(bytes) tokens.
            expected = sum(echoed.token_logprobs[-len(continuation.encode()):])
            assert math.isfinite(loglikelihood) and loglikelihood < 0
            assert math.isclose(loglikelihood, expected, abs_tol=1e-3), (context, continuation)


def test_generate_until_task_gets_the_servers_greedy_completions(lm_eval_run, server):
    results, samples = lm_eval_run
    docs = _read_jsonl(DATA / "tiny_generate.jsonl")
    assert 0.0 <= results["results"]["tandem_tiny_generate"]["exact_match,none"] <= 1.0
    assert len(samples["tandem_tiny_generate"]) == len(docs)
    oai = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    for sample in samples["tandem_tiny_generate"]:
        expected = oai.completions.create(model=MODEL, prompt=sample["doc"]["prompt"], max_tokens=8, temperature=0,
                                          stop=["\n"]).choices[0].text
        assert sample["resps"][0][0] == expected
