"""`tandem serve` with DBO across two hosts: torchrun nodes in two network namespaces joined
by a shaped link (benchmarks/netns_cluster.py), the official `openai` client running inside
the first host. Greedy tokens equal the one-host run; a cut link or a killed node turns
`/health` to 503 within the step timeout, in-flight requests end with an error, and no
process is left on either host."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import openai
import pytest

from tandem.testing.server_process import Server

from tandem.testing.netns_cluster import NetnsCluster, namespaces_available, torchrun_argv  # noqa: E402

_ok, _reason = namespaces_available()
#: Real processes in network namespaces: not in the fast tier, `-m "not slow"`.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_reason}")]

DBO_FLAGS = ["--enable-dbo", "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "8"]
STEP_TIMEOUT_S = 6
HTTP_PORT = 8000  # inside h0's own namespace: nothing else listens there
PROMPTS = ["two hosts", "a shaped link between them", "x"]
MAX_TOKENS = 8

#: Run inside h0's namespace: the official client against the server on h0's loopback.
CLIENT = textwrap.dedent(
    """
    import json, sys, threading, time
    import httpx, openai

    base = "http://127.0.0.1:%d"
    command = sys.argv[1]

    def wait_healthy(limit_s):
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        sys.exit("server did not become healthy")

    wait_healthy(240)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    if command == "complete":
        texts = []
        for prompt in json.loads(sys.argv[2]):
            stream = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=%d, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            texts.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
        print(json.dumps(texts), flush=True)
    elif command == "fault":
        outcome = {}

        def stream():
            try:
                chunks = client.completions.create(model="tiny-moe", prompt="in flight", max_tokens=1500,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True})
                for i, chunk in enumerate(chunks):
                    if i == 2:
                        print("streaming", flush=True)
                outcome["stream"] = "completed"
            except Exception as exc:
                outcome["stream"] = "error: " + type(exc).__name__ + ": " + str(exc)[:200]
                print("stream failed: " + outcome["stream"], flush=True)  # never leave the test waiting

        worker = threading.Thread(target=stream, daemon=True)
        worker.start()
        sys.stdin.readline()  # the test cuts the link or kills the node, then writes a line
        cut = time.monotonic()
        while time.monotonic() - cut < 120:
            try:
                response = httpx.get(base + "/health", timeout=2)
                if response.status_code == 503:
                    outcome["health"] = 503
                    outcome["health_after_s"] = time.monotonic() - cut
                    outcome["reason"] = response.text[:300]
                    break
            except httpx.HTTPError as exc:
                outcome["health"] = "unreachable: " + type(exc).__name__
                outcome["health_after_s"] = time.monotonic() - cut
                break
            time.sleep(0.2)
        worker.join(60)
        outcome.setdefault("stream", "still running")
        print(json.dumps(outcome), flush=True)
    """
)


def _serve_node(cluster: NetnsCluster, node: int, *extra: str) -> list[str]:
    return torchrun_argv(
        nnodes=2, node_rank=node, master_addr=cluster.hosts[0].address, master_port=29500,
        args=["tandem", "serve", "tiny-moe", "--port", str(HTTP_PORT), "--step-timeout", str(STEP_TIMEOUT_S),
              *DBO_FLAGS, *extra],
    )


def _start(cluster: NetnsCluster, *extra: str) -> list[subprocess.Popen]:
    env = lambda i: {**cluster.env(i), "OMP_NUM_THREADS": "1"}  # noqa: E731
    return [cluster.popen(i, _serve_node(cluster, i, *extra), env=env(i), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL) for i in range(2)]


def _client(tmp_path: Path) -> Path:
    path = tmp_path / "client.py"
    path.write_text(CLIENT % (HTTP_PORT, MAX_TOKENS))
    return path


def _wait_all_exit(procs: list[subprocess.Popen], limit_s: float) -> list[int | None]:
    deadline = time.monotonic() + limit_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    return [proc.poll() for proc in procs]


def _live_pids(cluster: NetnsCluster) -> list[str]:
    return [pid for host in cluster.hosts for pid in
            subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout.split()]


def _wait_no_pids(cluster: NetnsCluster, limit_s: float) -> list[str]:
    """The processes still alive on the hosts once they all ended or `limit_s` passed (the
    front end answers 503 for a few seconds after its head failed, then stops)."""
    deadline = time.monotonic() + limit_s
    while (pids := _live_pids(cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return pids


@pytest.fixture(scope="module")
def one_host_texts():
    with Server("tiny-moe", "--data-parallel-size", "2", *DBO_FLAGS, env={"OMP_NUM_THREADS": "1"}) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        return [client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for prompt in PROMPTS]


def _fault_is_reported_and_everything_ends(cluster: NetnsCluster, client_script: Path,
                                            nodes: list[subprocess.Popen], inject) -> None:
    """While a stream is in flight, `inject` a fault: /health turns 503 within the step timeout
    (the watchdog) plus the front end's notice, the stream ends with an error, both torchrun
    nodes end by themselves and no process stays behind on either host."""
    probe = cluster.popen(0, [sys.executable, str(client_script), "fault"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = probe.stdout.readline().strip()
    assert line == "streaming", f"the stream never started: {line!r} {probe.stderr.read()[-2000:] if not line else ''}"
    inject()
    probe.stdin.write("go\n")
    probe.stdin.flush()
    out, err = probe.communicate(timeout=240)
    assert probe.returncode == 0, err[-2000:]
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome["health"] == 503, outcome
    assert outcome["health_after_s"] < STEP_TIMEOUT_S + 30, outcome
    assert outcome["stream"].startswith("error"), outcome
    codes = _wait_all_exit(nodes, 6 * STEP_TIMEOUT_S + 60)
    assert None not in codes, f"a node still runs after the fault: {codes}"
    assert _wait_no_pids(cluster, 30) == [], "a process outlived its node"


@pytest.mark.timeout(900)
def test_dbo_serve_across_two_hosts_matches_one_host_and_a_cut_link_is_a_503(tmp_path, one_host_texts):
    with NetnsCluster(2, rate_mbit=200) as cluster:
        client_script = _client(tmp_path)
        nodes = _start(cluster)
        reply = cluster.run(0, [sys.executable, str(client_script), "complete", json.dumps(PROMPTS)], timeout=400)
        assert reply.returncode == 0, reply.stderr[-3000:]
        assert json.loads(reply.stdout.strip().splitlines()[-1]) == one_host_texts

        _fault_is_reported_and_everything_ends(cluster, client_script, nodes, lambda: cluster.set_link_up(1, False))


@pytest.mark.timeout(600)
def test_a_killed_node_is_a_503_and_the_other_node_ends(tmp_path):
    with NetnsCluster(2, rate_mbit=200) as cluster:
        client_script = _client(tmp_path)
        nodes = _start(cluster)

        def kill_node_1():
            for pid in subprocess.run(["ip", "netns", "pids", cluster.hosts[1].name], capture_output=True,
                                      text=True).stdout.split():
                subprocess.run(["kill", "-9", pid])

        _fault_is_reported_and_everything_ends(cluster, client_script, nodes, kill_node_1)


@pytest.mark.timeout(600)
def test_sigterm_to_both_nodes_drains_writes_the_trace_and_leaves_nothing(tmp_path):
    # A supervisor on each host stops its torchrun node. The ranks ignore the signal torchrun
    # relays; node 0's front end drains (the 1500-token stream runs into the 5 s
    # --shutdown-timeout and ends with an error, or finishes), then every rank stops.
    trace = tmp_path / "serve.json"
    with NetnsCluster(2, rate_mbit=200) as cluster:
        client_script = _client(tmp_path)
        nodes = _start(cluster, "--shutdown-timeout", "5", "--trace", str(trace))
        probe = cluster.popen(0, [sys.executable, str(client_script), "fault"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = probe.stdout.readline().strip()
        assert line == "streaming", f"the stream never started: {line!r}"
        for node in nodes:
            node.send_signal(subprocess.signal.SIGTERM)
        probe.stdin.write("go\n")
        probe.stdin.flush()
        out, err = probe.communicate(timeout=240)
        outcome = json.loads(out.strip().splitlines()[-1])
        assert outcome["health"] == 503 and outcome["health_after_s"] < 5, outcome
        assert outcome["stream"] == "completed" or "--shutdown-timeout 5 s" in outcome["stream"], outcome
        # torchrun exits 1 after a signal whatever its workers did (it re-raises it).
        assert _wait_all_exit(nodes, 60) == [1, 1]
        assert json.loads(trace.read_text())["traceEvents"]
        assert _wait_no_pids(cluster, 10) == [], "a process outlived its node"
