"""`tandem profile`: where one decode step and one prefill step of a model spend their time,
per module, next to what the modules must move and compute (`step_cost`) and what this
device can do (`roofline`, measured in the same run).

One rank, the normal engine loop (scheduler → plan → inputs → forward → sample → read →
apply, in sequence, so every row is this step's own). A round adds `batch` requests of
`prompt_len` random tokens, runs their prefill as one step and then `decode_steps` decode
steps, and aborts them. The first round runs the model's eager forward with the hooks in, only
to record what each region's step moves and computes (`step_cost`): the bytes, FLOPs and
weight floor are a property of the model and the batch, so a compiled step, whose graph no
hook sees inside, reports the same ones. Then per phase `repeat` timed rounds alternate
between hooked (rows timed) and plain (the step alone, to show what the hooks cost); one last
round counts kernels with an `OpCounter` (ATen ops and Triton launches; its times are not
used: the dispatch mode slows every op). On CUDA a final round runs its first prefill and
decode step under `torch.profiler` for the real GPU kernels by name (`gpu_kernels`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from tandem.bench import gpu_kernels
from tandem.bench.op_count import OpCounter, scope_kernels, step_kernels
from tandem.bench.profile_regions import Instrument, StepRecord
from tandem.bench.roofline import Roofline, measure_roofline
from tandem.bench.step_cost import Cost, distinct_experts, experts_cost, logits_cost, module_cost
from tandem.worker.ubatch_wrapper import eager_unless_asked

PHASES = ("prefill", "decode")


def profile_config(config, batch: int, prompt_len: int, decode_steps: int):
    """`config` made to fit the profile: one rank, the normal loop, all `batch` prompts in one
    prefill step, and a KV cache that holds every request to its last decode step."""
    if config.parallel.world_size != 1:
        raise ValueError("tandem profile runs one rank: leave --data-parallel-size and --pipeline-parallel-size at 1")
    block = config.cache.block_size
    per_request = -(-(prompt_len + decode_steps + 1) // block) * block
    return dataclasses.replace(
        config,
        overlap=eager_unless_asked(config.overlap),  # module hooks do not fire inside a graph replay
        max_num_batched_tokens=max(config.max_num_batched_tokens, batch * prompt_len),
        scheduler=dataclasses.replace(config.scheduler, overlap_schedule=False, max_num_seqs=batch),
        cache=dataclasses.replace(config.cache, num_kv_blocks=None,
                                  kv_cache_tokens=max(config.cache.kv_cache_tokens, batch * per_request)),
    )


class StepProfiler:
    def __init__(self, engine, *, batch: int, prompt_len: int, decode_steps: int, seed: int = 0):
        self.engine, self.batch, self.prompt_len, self.decode_steps = engine, batch, prompt_len, decode_steps
        self.device = engine.runner.device
        self.on_gpu = self.device.type == "cuda"
        self.instrument = Instrument(engine, self.on_gpu)
        self.vocab = engine.runner.model.model.embed_tokens.num_embeddings
        self.generator = torch.Generator().manual_seed(seed)
        self._round = 0
        #: Per phase: plain step seconds, hooked step seconds, per-step region seconds, records.
        self.plain = {p: [] for p in PHASES}
        self.hooked = {p: [] for p in PHASES}
        self.rows = {p: [] for p in PHASES}
        self.records: dict[str, StepRecord] = {}
        #: Per phase: the eager step's record, whose shapes, calls and routing give the costs.
        self.cost_records: dict[str, StepRecord] = {}
        self.kernels: dict[str, OpCounter] = {}
        #: Per phase, on CUDA: `gpu_kernels.summarise_kernels` of one profiled step.
        self.gpu_kernels: dict[str, dict] = {}

    def _round_of_steps(self, on_step) -> None:
        """Add the batch, prefill it, decode it, abort it; `on_step(phase, run)` runs each step."""
        from tandem.worker.sampling import SamplingParams

        params = SamplingParams(max_tokens=self.decode_steps + 8, temperature=0.0, ignore_eos=True)
        ids = [f"profile-{self._round}-{i}" for i in range(self.batch)]
        self._round += 1
        for rid in ids:
            prompt = torch.randint(2, self.vocab, (self.prompt_len,), generator=self.generator).tolist()
            error = self.engine.add_request(rid, prompt, params)
            if error is not None:
                raise ValueError(f"the profile's request was refused: {error.error}")
        for phase in ("prefill", *["decode"] * self.decode_steps):
            on_step(phase, self.engine.step)
        for rid in ids:
            self.engine.abort(rid)

    def _timed_step(self, phase: str, step) -> float:
        start = time.perf_counter()
        step()
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def run(self, repeat: int) -> None:
        with self.instrument.installed(), _eager_forward(self.engine.runner.model):
            self._round_of_steps(self._cost_step)
        self._round_of_steps(lambda phase, step: step())  # warm-up: allocation, JIT, caches
        for _ in range(repeat):
            self._round_of_steps(lambda phase, step: self.plain[phase].append(self._timed_step(phase, step)))
            with self.instrument.installed():
                self._round_of_steps(self._hooked_step)
        with self.instrument.installed():
            self._round_of_steps(self._counted_step)
        if self.on_gpu:
            self._round_of_steps(self._gpu_profiled_step)

    def _gpu_profiled_step(self, phase: str, step) -> None:
        if phase in self.gpu_kernels:
            step()
            return
        try:
            self.gpu_kernels[phase] = gpu_kernels.profile_step(step, self.device)
        except RuntimeError as error:  # no CUPTI: the rest of the profile still stands
            self.gpu_kernels[phase] = {"error": f"{type(error).__name__}: {error}"}

    def _cost_step(self, phase: str, step) -> None:
        self.instrument.record = self.cost_records[phase] = StepRecord()  # decode: the round's last step
        step()

    def _hooked_step(self, phase: str, step) -> None:
        self.instrument.record = record = StepRecord()
        self.hooked[phase].append(self._timed_step(phase, step))
        self.rows[phase].append(record.seconds(self.on_gpu))
        self.records[phase] = record  # shapes are the same every round: keep the last

    def _counted_step(self, phase: str, step) -> None:
        if phase in self.kernels:
            step()
            return
        self.instrument.record = StepRecord()
        counter = self.instrument.counter = OpCounter()
        try:
            with counter:
                step()
        finally:
            self.instrument.counter = None
        self.kernels[phase] = counter

    # -- the table ------------------------------------------------------------------------------

    def phase_report(self, phase: str, roofline: Roofline) -> dict:
        record, regions = self.records[phase], self.instrument.regions
        costs = self._costs(phase)
        step_s = statistics.median(self.hooked[phase])
        counter = self.kernels.get(phase)
        rows = []
        for key in _table_order(regions):
            region, cost = regions[key], costs[key]
            seconds = statistics.median(r.get(key, 0.0) for r in self.rows[phase])
            floor = roofline.floor_s(cost.bytes, cost.flops)
            rows.append({
                "row": key, "label": region.label, "parent": region.parent, "depth": _depth(regions, key),
                "clock": region.clock, "calls": record.calls[key], "ms": 1000 * seconds,
                "share_of_step": seconds / step_s if step_s else 0.0,
                **scope_kernels(counter, key),
                "weight_bytes": cost.weight_bytes, "activation_bytes": cost.activation_bytes,
                "kv_bytes": cost.kv_bytes, "flops": cost.flops, "floor_ms": 1000 * floor,
                "roofline_share": floor / seconds if seconds > 0 and cost.bytes + cost.flops > 0 else None,
            })
        weights = costs["forward"].weight_bytes + costs["sample"].weight_bytes
        # Weights are only read: their floor is the read-only stream's (a copy's rate, which
        # also writes, would put the floor too high and let a row pass 100 %).
        weight_floor_s = weights / roofline.read_bandwidth_bytes_per_s
        layers = len(regions["layers.*"].modules)
        return {
            "phase": phase, "tokens": record.forward_tokens, "requests": self.batch,
            "step_ms": 1000 * step_s, "step_ms_without_hooks": 1000 * statistics.median(self.plain[phase]),
            "weight_bytes": weights, "weight_floor_ms": 1000 * weight_floor_s,
            "weight_floor_at_copy_rate_ms": 1000 * weights / roofline.bandwidth_bytes_per_s,
            "step_over_weight_floor": step_s / weight_floor_s if weight_floor_s else None,
            **step_kernels(counter, "layers.*", layers),
            "decoder_layers": layers, "rows": rows, "gpu_kernels": self.gpu_kernels.get(phase),
        }

    def _costs(self, phase: str) -> dict[str, Cost]:
        """Per region, what the eager step of `phase` moved and computed."""
        record, regions = self.cost_records[phase], self.instrument.regions
        touched = {block_id: distinct_experts(ids) for block_id, ids in record.topk_ids.items()}
        lm_weight = _logits_weight(self.engine.runner.model)
        costs = {key: _region_cost(region, record, touched, lm_weight) for key, region in regions.items()}
        for key in _children_first(regions):
            if regions[key].cost == "children":
                kids = [k for k, r in regions.items() if r.parent == key]
                costs[key] = sum((costs[k] for k in kids), Cost(activation_bytes=record.activation_bytes[key]))
        return costs


@contextmanager
def _eager_forward(model):
    """Inside, `model` runs its class's forward: `CompiledModel` compiles in place by setting
    the instance's `forward`, so taking that attribute away for a while is the eager step, the
    one whose module hooks fire."""
    compiled = vars(model).pop("forward", None)
    try:
        yield
    finally:
        if compiled is not None:
            model.forward = compiled


def _region_cost(region, record: StepRecord, touched: dict[int, int], lm_weight: torch.Tensor) -> Cost:
    measured = Cost(activation_bytes=record.activation_bytes[region.key])
    calls = record.calls[region.key]
    if region.cost in ("host", "router", "children") or calls == 0:
        return measured
    if region.cost == "logits":
        return measured + logits_cost(lm_weight, record.sampled_rows)
    per_module_calls = calls / max(len(region.modules), 1)
    tokens = record.forward_tokens / max(per_module_calls, 1)
    total = Cost()
    for module in region.modules:
        if region.cost == "gate":
            one = module_cost(module.gate, int(tokens), record.shape, touched)
        elif region.cost == "experts":
            one = experts_cost(module, int(tokens), touched.get(id(module), len(module.experts.local)))
        else:
            one = module_cost(module, int(tokens), record.shape, touched)
        total = total + Cost(*(per_module_calls * v for v in dataclasses.astuple(one)))
    return measured + total


def _logits_weight(model) -> torch.Tensor:
    """The LM head's weight: its own, or the embedding's when the two are tied."""
    return model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight


def _depth(regions, key) -> int:
    parent = regions[key].parent
    return 0 if parent is None else 1 + _depth(regions, parent)


def _children_first(regions) -> list[str]:
    return sorted(regions, key=lambda k: -_depth(regions, k))


def _table_order(regions) -> list[str]:
    """Depth-first: each row, then its children, in the order the regions were found."""
    order: list[str] = []

    def visit(parent):
        for key, region in regions.items():
            if region.parent == parent:
                order.append(key)
                visit(key)

    visit(None)
    return order


def run_profile(config, *, batch: int, prompt_len: int, decode_steps: int = 4, repeat: int = 3,
                roofline_sizes: dict | None = None) -> dict:
    """Build one rank of `config` and profile its prefill and decode steps; the report as a
    dict. `roofline_sizes`: `measure_roofline`'s copy_mib / matmul_size (default: its own)."""
    from tandem.engine.build import build_engine
    from tandem.worker.build import build_runner

    if min(batch, prompt_len, decode_steps, repeat) < 1:
        raise ValueError("--batch, --prompt-len, --decode-steps and --repeat must be >= 1")
    config = profile_config(config, batch, prompt_len, decode_steps)
    runner = build_runner(config)
    engine = build_engine(config, runner=runner)
    model = runner.model
    dtype = next(model.parameters()).dtype
    roofline = measure_roofline(runner.device, dtype, **(roofline_sizes or {}))
    with torch.no_grad():
        profiler = StepProfiler(engine, batch=batch, prompt_len=prompt_len, decode_steps=decode_steps)
        profiler.run(repeat)
    return {
        "model": config.model, "device": str(runner.device), "device_name": _device_name(runner.device),
        "dtype": str(dtype).removeprefix("torch."), "batch": batch, "prompt_len": prompt_len,
        "decode_steps": decode_steps, "repeat": repeat, "graph_mode": runner.wrapper.graph_mode,
        "dbo": config.overlap.enable_dbo, "compiled": runner.compiled is not None, "moe_backend": config.parallel.moe_backend,
        "all2all_backend": config.parallel.all2all_backend, "torch": torch.__version__,
        "roofline": roofline.as_dict(),
        "phases": {phase: profiler.phase_report(phase, roofline) for phase in PHASES},
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f}" if value else "-"


def format_report(report: dict) -> str:
    """The tables, one per phase, as Markdown."""
    r = report["roofline"]
    lines = [
        f"{report['model']} on {report['device']} ({report['device_name']}), {report['dtype']}, "
        f"batch {report['batch']} x prompt {report['prompt_len']}, moe {report['moe_backend']}, "
        f"graph {report['graph_mode']}, dbo {'on' if report['dbo'] else 'off'}",
        f"measured here: bandwidth {r['read_bandwidth_gb_per_s']:.1f} GB/s read-only (sum), "
        f"{r['bandwidth_gb_per_s']:.1f} GB/s copying ({r['copy_bytes'] >> 20} MiB), "
        f"{r['dtype']} matmul {r['matmul_tflops'] * 1000:.1f} GFLOP/s ({r['matmul_size']}^3)",
    ]
    if report.get("compiled"):
        lines.append("compiled step (--compile): module hooks do not fire inside the compiled graph, so the rows "
                     "under 'forward' have calls and times only where the opaque MoE op runs them eagerly, and the "
                     "kernel counts are partial; the step and forward totals are right, and every row's bytes, FLOPs "
                     "and the weight floor come from one unmeasured eager pass of the step, as without --compile "
                     "(per-setting step times: benchmarks/compiled_step.py)")
    for phase in PHASES:
        lines += _phase_lines(phase, report["phases"][phase])
    lines += _gpu_kernel_lines(report)
    return "\n".join(lines)


def _count(value) -> str:
    return "-" if value is None else str(value)


def _per_layer(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _kernel_summary(p: dict) -> str:
    """The phase's kernels: per step and per decoder layer, ATen and Triton; Triton by name."""
    text = (f"kernels {_count(p['kernels_per_step'])} per step ({_count(p.get('aten_kernels_per_step'))} ATen + "
            f"{_count(p.get('triton_launches_per_step'))} Triton), {_per_layer(p['kernels_per_decoder_layer'])} per "
            f"decoder layer ({_per_layer(p.get('aten_kernels_per_decoder_layer'))} + "
            f"{_per_layer(p.get('triton_launches_per_decoder_layer'))})")
    by_kernel = p.get("triton_by_kernel")
    if by_kernel:
        text += "; Triton launches per step: " + ", ".join(f"{name} x{n}" for name, n in by_kernel.items())
    return text


def _phase_lines(phase: str, p: dict) -> list[str]:
    lines = [
        "",
        f"## {phase}: {p['tokens']} tokens, step {p['step_ms']:.2f} ms (without hooks "
        f"{p['step_ms_without_hooks']:.2f} ms); weights {p['weight_bytes'] / 1e6:.1f} MB -> floor "
        f"{p['weight_floor_ms']:.3f} ms read-only ({p['weight_floor_at_copy_rate_ms']:.3f} ms at the copy's rate); "
        f"step = {p['step_over_weight_floor']:.1f}x the weight-bandwidth floor; {_kernel_summary(p)}",
        "",
        "| region | clock | calls | ms | % step | kernels | of which Triton | weights MB | activations MB | KV MB | GFLOP "
        "| floor ms | % roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in p["rows"]:
        share = row["roofline_share"]
        lines.append(
            f"| {'  ' * row['depth']}{row['label']} | {row['clock']} | {row['calls']} | {row['ms']:.3f} | "
            f"{100 * row['share_of_step']:.1f} | {_count(row['kernels'])} | {_count(row.get('triton_launches'))} | "
            f"{_mb(row['weight_bytes'])} | {_mb(row['activation_bytes'])} | {_mb(row['kv_bytes'])} | "
            f"{row['flops'] / 1e9:.3f} | {row['floor_ms']:.3f} | {'-' if share is None else f'{100 * share:.1f}'} |"
        )
    return lines


def _gpu_kernel_lines(report: dict) -> list[str]:
    """After the tables: the torch.profiler pass's kernels per phase, or why there is none."""
    summaries = {phase: report["phases"][phase].get("gpu_kernels") for phase in PHASES}
    if not any(summaries.values()):
        return ["", gpu_kernels.SKIPPED_ON_CPU if not report["device"].startswith("cuda") else
                "GPU kernels (torch.profiler): none recorded"]
    return [line for phase, summary in summaries.items() if summary for line in gpu_kernels.format_kernels(phase, summary)]


def write_report(path: str | Path, report: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


__all__ = ["PHASES", "StepProfiler", "format_report", "profile_config", "run_profile", "write_report"]
