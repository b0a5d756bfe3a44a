"""Pipeline parallelism through `tandem serve`: pp1 vs pp2 output tokens/s as a user sees them.

Each configuration is a real `tandem serve` subprocess (or, with `--hosts 2`, torchrun nodes)
driven by the official `openai` client:
S concurrent streaming completions (same prompts and seeds every run, `ignore_eos`) of a fixed
number of tokens each. tok/s is the tokens the server generated (its /metrics counter) over the
client's wall time for the whole batch of streams. Configurations are interleaved per repeat
(each server is started once and kept), the table shows the median (min-max) over `--repeat`
runs, ratios from those medians.

    python benchmarks/pipeline_serve.py                        # tiny-moe, 8 and 64 streams
    python benchmarks/pipeline_serve.py --streams 64 --repeat 5
    sudo python benchmarks/pipeline_serve.py --hosts 2 --model small-moe --streams 64 \
        --json benchmarks/results/pipeline_serve_hosts.json     # two pinned namespace hosts

`--hosts 2` runs the servers on two namespace hosts (benchmarks/netns_cluster.py, a shaped
link) as two machines of one core each: every process of host i is pinned to core i
(`taskset -c i`, OMP_NUM_THREADS=1). pp1 is `tandem serve` on host 0 alone; pp2 is one torchrun
node per host (stage i on host i, the front end beside stage 0). The client runs on host 0
(pinned to `--client-core`, default 0: the same load beside both configurations' head).

Writes benchmarks/results/pipeline_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
from tandem.testing.server_process import Server, rank_pids  # noqa: E402

CONFIGS = {
    "pp1": (),
    "pp2": ("--pipeline-parallel-size", "2"),
    # The first stage also schedules and (through serve) shares its host with the front end:
    # on small-moe (5 layers) the default split 3,2 gives it the dense layer and two MoE layers.
    "pp2-2,3": ("--pipeline-parallel-size", "2", "--pp-layer-partition", "2,3"),
}
STAGES = {"pp1": 1, "pp2": 2, "pp2-2,3": 2}
DEFAULT_CONFIGS = ["pp1", "pp2"]


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def _drive(url: str, model: str, streams: int, max_tokens: int) -> float:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    async def one(i: int) -> None:
        stream = await client.completions.create(
            model=model, prompt=f"request {i}: " + "pipeline stages " * (1 + i % 5), max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            pass

    start = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(streams)))
    finally:
        await client.close()
    return time.perf_counter() - start


def _run(base: str, model: str, streams: int, max_tokens: int) -> float:
    """Output tokens/s of `streams` concurrent streams against the server at `base`."""
    before = _metric(base, "tandem_engine_generated_tokens_total")
    wall = asyncio.run(_drive(f"{base}/v1", model, streams, max_tokens))
    deadline = time.monotonic() + 5
    while True:  # the ranks report their counters every 0.25 s
        tokens = _metric(base, "tandem_engine_generated_tokens_total") - before
        if tokens >= streams * max_tokens or time.monotonic() > deadline:
            return tokens / wall
        time.sleep(0.1)


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and all their descendants (Linux /proc)."""
    total, ticks = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in set(pids) | set(rank_pids(pids)):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


class LocalServers:
    """Every configuration as a `tandem serve` subprocess on this host."""

    def __init__(self, stack: contextlib.ExitStack, args, common: tuple[str, ...]):
        self.args = args
        self.servers = {name: stack.enter_context(Server(args.model, *common, *CONFIGS[name], startup_timeout_s=600))
                        for name in args.configs}
        for server in self.servers.values():
            asyncio.run(_drive(server.url, args.model, 4, 8))  # warm the HTTP path

        self.cpu_ms_per_token: dict[str, list[list[float]]] = {name: [] for name in args.configs}

    def run(self, name: str, streams: int) -> float:
        server = self.servers[name]
        before = _cpu_seconds([server.proc.pid])
        tok_s = _run(server.base, self.args.model, streams, self.args.max_tokens)
        tokens = streams * self.args.max_tokens
        self.cpu_ms_per_token[name].append([1000 * (_cpu_seconds([server.proc.pid]) - before) / tokens])
        return tok_s

    def output(self, name: str) -> str:
        return self.servers[name].output()


class PinnedHostServers:
    """pp1 on namespace host 0 alone, pp2 as one torchrun node per host; every process of host
    i pinned to core i with one compute thread, as two one-core machines would run them."""

    BASE_PORT = 8001  # inside host 0's namespace: nothing else listens there

    def __init__(self, stack: contextlib.ExitStack, args, common: tuple[str, ...]):
        from tandem.testing.netns_cluster import NetnsCluster, torchrun_argv

        self.args = args
        self.cluster = stack.enter_context(NetnsCluster(2, rate_mbit=args.rate_mbit, prefix="tdps"))
        self.logs: dict[str, Path] = {}
        self.procs: dict[str, list] = {}
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipeline_serve_")))
        self.ports = {name: self.BASE_PORT + i for i, name in enumerate(args.configs)}
        for index, name in enumerate(args.configs):
            serve = ["tandem", "serve", args.model, "--port", str(self.ports[name]), *common, *CONFIGS[name]]
            hosts = range(STAGES[name])  # one stage per host
            self.logs[name] = log_dir / f"{name}.log"
            self.procs[name] = []
            for host in hosts:
                argv = ([sys.executable, "-m", *serve] if len(hosts) == 1 else
                        torchrun_argv(nnodes=len(hosts), node_rank=host, master_addr=self.cluster.hosts[0].address,
                                      master_port=29500 + index, args=serve))
                log = open(log_dir / f"{name}.{host}.log" if host else self.logs[name], "w")
                stack.callback(log.close)
                self.procs[name].append(self.cluster.popen(host, self._pinned(host, argv), env=self._env(host),
                                                           stdout=log, stderr=subprocess.STDOUT))
        for name in args.configs:
            self._wait_ready(name)
            self.run(name, 4, max_tokens=8)  # warm the HTTP path
        #: config -> per run [host 0's server processes, host 1's, the client], CPU ms per token.
        self.cpu_ms_per_token: dict[str, list[list[float]]] = {name: [] for name in args.configs}

    def _pinned(self, host: int, argv: list[str]) -> list[str]:
        return ["taskset", "-c", str(host), *argv]

    def _env(self, host: int) -> dict[str, str]:
        return {**self.cluster.env(host), "OMP_NUM_THREADS": "1"}

    def _wait_ready(self, name: str, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "] ready: http" not in self.output(name):
            dead = [p.returncode for p in self.procs[name] if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start (exit codes {dead}):\n{self.output(name)[-3000:]}")
            time.sleep(0.5)

    def run(self, name: str, streams: int, max_tokens: int | None = None) -> float:
        """Drive the server from host 0 (the client is a process there, pinned like the rest)."""
        driver = [sys.executable, str(Path(__file__).resolve()), "--drive", f"http://127.0.0.1:{self.ports[name]}",
                  "--model", self.args.model, "--streams", str(streams),
                  "--max-tokens", str(max_tokens or self.args.max_tokens)]
        pids = [[proc.pid] for proc in self.procs[name]]
        before = [_cpu_seconds(host) for host in pids]
        done = self.cluster.run(0, ["taskset", "-c", str(self.args.client_core), *driver], env=self._env(0),
                                timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"the client on host 0 failed:\n{done.stderr[-3000:]}\n{self.output(name)[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if max_tokens is None:
            tokens = streams * self.args.max_tokens
            used = [_cpu_seconds(host) - b for host, b in zip(pids, before)] + [0.0] * (2 - len(pids))
            self.cpu_ms_per_token[name].append([1000 * c / tokens for c in (*used, result["cpu_s"])])
        return result["tok_s"]

    def output(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")


def _table(args, runs: dict[str, dict[int, list[float]]]) -> list[dict]:
    rows = []
    where = "two pinned namespace hosts" if args.hosts == 2 else "one host"
    print(f"\n{args.model} through `tandem serve` on {where}, {args.max_tokens} tokens per stream, "
          f"median of {args.repeat} (min-max)")
    print(f"{'config':<8} {'streams':>7} {'tok/s':>8} {'min-max':>13} {'vs pp1':>7}")
    for streams in args.streams:
        base = statistics.median(runs["pp1"][streams]) if "pp1" in runs else None
        for name in args.configs:
            values = runs[name][streams]
            median = statistics.median(values)
            ratio = median / base if base else None
            rows.append({"config": name, "streams": streams, "tok_s": median, "min": min(values), "max": max(values),
                         "vs_pp1": ratio, "runs": values})
            ratio_text = f"{ratio:.2f}x" if ratio else "-"
            print(f"{name:<8} {streams:>7} {median:>8.0f} {min(values):>6.0f}-{max(values):<6.0f} {ratio_text:>7}")
    return rows


def _cpu_table(args, cpu: dict[str, list[list[float]]]) -> dict:
    """CPU ms per generated token, medians over the runs: what each config costs the cores
    whatever else runs on them. With one core per host, 1 / (the busiest core's ms per token)
    bounds a configuration's tok/s on a quiet machine; the ratio of those bounds is what
    pinned hosts would give without hand-off latency."""
    print("\nCPU ms per generated token (median over runs; user + system, every server process)")
    summary = {}
    for name in args.configs:
        columns = [statistics.median(column) for column in zip(*cpu[name])] if cpu[name] else []
        if args.hosts == 2 and columns:
            cores = [columns[0], columns[1]]
            cores[args.client_core] += columns[2]
            summary[name] = {"host0": columns[0], "host1": columns[1], "client": columns[2], "cores": cores,
                             "busiest_core": max(cores)}
            print(f"{name:<8} host0 {columns[0]:6.2f}  host1 {columns[1]:6.2f}  client {columns[2]:6.2f}  "
                  f"busiest core {max(cores):6.2f}")
        elif columns:
            summary[name] = {"server": columns[0]}
            print(f"{name:<8} server {columns[0]:6.2f}")
    if args.hosts == 2 and "pp1" in summary:
        for name in summary:
            summary[name]["bound_vs_pp1"] = summary["pp1"]["busiest_core"] / summary[name]["busiest_core"]
            print(f"  {name}: busiest-core bound {summary[name]['bound_vs_pp1']:.2f}x pp1")
    return summary


def _load_average() -> list[float]:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    parser.add_argument("--extra", default="", help="More serve flags for every configuration, space separated.")
    parser.add_argument("--hosts", type=int, default=1, choices=(1, 2),
                        help="2: pinned namespace hosts, one core each (needs root)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="--hosts 2: the link's rate each way")
    parser.add_argument("--client-core", type=int, default=0, help="--hosts 2: the core the client runs on")
    parser.add_argument("--drive", default=None, help=argparse.SUPPRESS)  # one client run against this server
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "pipeline_serve.json")
    args = parser.parse_args()
    if args.drive:
        tok_s = _run(args.drive, args.model, args.streams[0], args.max_tokens)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        print(json.dumps({"tok_s": tok_s, "cpu_s": usage.ru_utime + usage.ru_stime}))
        return 0
    def stop(signum, frame):  # SIGTERM (timeout, a supervisor) unwinds like Ctrl-C: servers and namespaces go
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    started, load_before = time.time(), _load_average()
    common = ("--kv-cache-tokens", "16384", "--max-num-seqs", str(max(args.streams)), *args.extra.split())
    runs: dict[str, dict[int, list[float]]] = {name: {s: [] for s in args.streams} for name in args.configs}
    with contextlib.ExitStack() as stack:
        servers = (PinnedHostServers if args.hosts == 2 else LocalServers)(stack, args, common)
        for r in range(args.repeat):
            for streams in args.streams:
                for name in args.configs:
                    runs[name][streams].append(servers.run(name, streams))
                    print(f"[pipeline serve] run {r + 1} {name} {streams} streams: {runs[name][streams][-1]:.0f} tok/s",
                          file=sys.stderr, flush=True)
        logs = {name: servers.output(name) for name in args.configs}
    rows = _table(args, runs)
    cpu = _cpu_table(args, servers.cpu_ms_per_token)
    notes = [line for text in logs.values() for line in text.splitlines() if "pipeline parallelism" in line]
    for line in notes:
        print(f"  server said: {line}")
    load = {"before": load_before, "after": _load_average()}
    print(f"load average before {load['before']}, after {load['after']} (2 cores, shared)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("json", "drive")},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average": load},
        "rows": rows, "cpu_ms_per_token": cpu, "server_notes": notes, "wall_s": time.time() - started,
    }, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
