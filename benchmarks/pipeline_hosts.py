"""Pipeline parallelism across two network hosts: `tandem generate` on small-moe as one process
on one host (pp1) against two pipeline stages, one per host, as torchrun nodes (pp2), on a
shaped link between namespace hosts (benchmarks/netns_cluster.py). Each host's process runs one
compute thread, as a host of its own would give it its own cores.

    sudo python benchmarks/pipeline_hosts.py                   # 64 prompts x 64 tokens, 3 rounds
    sudo python benchmarks/pipeline_hosts.py --prompts 8 --max-tokens 8 --repeat 1   # smoke run

The time is the command's own "generated N tokens ... in S s" line (model build included, the
same for both); pp1 and pp2 alternate within each round; tokens of the two are compared.
Prints a table and writes benchmarks/results/pipeline_hosts.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from tandem.testing.netns_cluster import NetnsCluster, namespaces_available, torchrun_argv  # noqa: E402

GENERATED = re.compile(r"generated (\d+) tokens for (\d+) prompts in ([\d.]+) s")


def _generate_args(args, extra: list[str]) -> list[str]:
    prompts = [f"prompt {i}: mixture of experts across hosts" for i in range(args.prompts)]
    return ["tandem", "generate", *prompts, "--model", args.model, "--max-tokens", str(args.max_tokens),
            "--ignore-eos", "--json", *extra]


def _parse(result, label: str) -> tuple[float, int, list]:
    if result.returncode != 0:
        raise RuntimeError(f"{label} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    match = GENERATED.search(result.stderr)
    if match is None:
        raise RuntimeError(f"{label}: no 'generated ...' line in its log:\n{result.stderr[-3000:]}")
    tokens, seconds = int(match.group(1)), float(match.group(3))
    outputs = [json.loads(line)["token_ids"] for line in result.stdout.splitlines() if line.startswith("{")]
    return tokens / seconds, tokens, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-moe")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--depth", type=int, default=0, help="--pp-async-batch-depth of pp2")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "pipeline_hosts.json"))
    args = parser.parse_args(argv)
    ok, reason = namespaces_available()
    if not ok:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2

    rows: dict[str, list[float]] = {"pp1": [], "pp2": []}
    same_tokens = True
    with NetnsCluster(2, rate_mbit=args.rate_mbit, prefix="tdph") as cluster:
        env = lambda i: {**cluster.env(i), "OMP_NUM_THREADS": "1"}  # noqa: E731
        for round_ in range(args.repeat):
            pp1 = cluster.run(0, [sys.executable, "-m", *_generate_args(args, [])], timeout=args.timeout, env=env(0))
            tok_s_1, _, out_1 = _parse(pp1, "pp1")
            pp2_args = _generate_args(args, ["--pipeline-parallel-size", "2", "--pp-async-batch-depth", str(args.depth)])
            # One compute thread per host process ("env": run_on_all takes one environment for all hosts).
            pp2 = cluster.run_on_all(
                lambda i: ["env", "OMP_NUM_THREADS=1",
                           *torchrun_argv(nnodes=2, node_rank=i, master_addr=cluster.hosts[0].address,
                                          master_port=29500 + round_, args=pp2_args)],
                timeout=args.timeout,
            )
            tok_s_2, _, out_2 = _parse(pp2[0], "pp2 (node 0)")
            if pp2[1].returncode != 0:
                raise RuntimeError(f"pp2 node 1 failed:\n{pp2[1].stderr[-3000:]}")
            same_tokens &= out_1 == out_2
            rows["pp1"].append(tok_s_1)
            rows["pp2"].append(tok_s_2)
            print(f"[pipeline hosts] round {round_ + 1}: pp1 {tok_s_1:.1f} tok/s, pp2 {tok_s_2:.1f} tok/s", file=sys.stderr)

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\n{args.model}, {args.prompts} prompts x {args.max_tokens} tokens, 2 namespace hosts at "
          f"{args.rate_mbit:g} Mbit/s, one compute thread per host; median of {args.repeat}")
    print(f"{'config':8} {'tok/s':>8} {'min-max':>15} {'vs pp1':>7}")
    for name, values in rows.items():
        print(f"{name:8} {med[name]:8.1f} {min(values):7.1f}-{max(values):<7.1f} {med[name] / med['pp1']:6.2f}x")
    print(f"same tokens: {same_tokens}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "config": vars(args), "tok_s": rows, "median_tok_s": med,
        "pp2_over_pp1": med["pp2"] / med["pp1"], "same_tokens": same_tokens,
    }, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
