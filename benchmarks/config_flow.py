"""Where the configuration travels from `serve_rank` (issue #33's measure): every call that
receives the config tree or one of its sections (`EngineConfig`, `SchedulerConfig`,
`ParallelConfig`, `OverlapConfig`, `CacheConfig`) as an argument while one tiny-moe rank starts,
warms up and stops, traced with `sys.setprofile`; which modules receive it, and how many of those
calls go from a module up into a higher layer (the layers of `tandem.testing.layers`).

    python benchmarks/config_flow.py

Prints the modules and the calls up a layer; writes benchmarks/results/config_flow.json.
"""

from __future__ import annotations

import collections
import json
import queue
import sys
from pathlib import Path

from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig, SchedulerConfig
from tandem.testing.layers import LAYERS, layer_of

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = (EngineConfig, SchedulerConfig, ParallelConfig, OverlapConfig, CacheConfig)
RANK = {name: i for i, name in enumerate(LAYERS)}


def trace_serve_rank() -> tuple[collections.Counter, collections.Counter]:
    """(calls receiving a config by (caller module, callee module.function), those going up a layer)."""
    from tandem.serving.ranks.messages import Shutdown
    from tandem.serving.ranks.rank import ServeOptions, serve_rank

    calls: collections.Counter = collections.Counter()
    ups: collections.Counter = collections.Counter()

    def profile(frame, event, arg) -> None:
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("tandem."):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if not any(isinstance(frame.f_locals.get(name), CONFIGS) for name in names):
            return
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        key = (caller, f"{module}.{code.co_name}")
        calls[key] += 1
        if layer_of(caller) in RANK and layer_of(module) in RANK and RANK[layer_of(module)] > RANK[layer_of(caller)]:
            ups[key] += 1

    inbox, outbox = queue.Queue(), queue.Queue()
    inbox.put(Shutdown())  # start, warm up, take the first message: stop
    sys.setprofile(profile)
    try:
        serve_rank(0, 1, EngineConfig(model="tiny-moe", device="cpu"), ServeOptions(), inbox, outbox)
    finally:
        sys.setprofile(None)
    return calls, ups


def main() -> int:
    calls, ups = trace_serve_rank()
    modules = sorted({callee.rsplit(".", 1)[0] for _, callee in calls})
    print(f"{len(modules)} modules receive the config from serve_rank: {', '.join(m.removeprefix('tandem.') for m in modules)}")
    print(f"calls into a higher layer: {sum(ups.values())} ({len(ups)} distinct)")
    for (caller, callee), count in sorted(ups.items()):
        print(f"  {caller} -> {callee}  x{count}")
    out = ROOT / "benchmarks" / "results" / "config_flow.json"
    out.write_text(json.dumps({
        "command": "python benchmarks/config_flow.py", "modules": modules,
        "calls_up_a_layer": [{"caller": c, "callee": m, "count": n} for (c, m), n in sorted(ups.items())],
        "calls": [{"caller": c, "callee": m, "count": n} for (c, m), n in sorted(calls.items())],
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
