"""`TANDEM_FAULT_INJECT`: parsing, and faults installed into a real single-rank engine."""

from __future__ import annotations

import time

import pytest

from tandem.config import OverlapConfig, SchedulerConfig
from tandem.models.tiny_moe import build_tiny_moe
from tandem.engine.core import Engine, StepTimeoutError
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampling import SamplingParams
from tandem.worker.faults import ENV_VAR, FaultSpec, parse_faults

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = list(range(3, 23))  # 20 tokens: with thresholds 0 every step is split in two ubatches


def test_parse_faults():
    assert parse_faults("") == []
    (one,) = parse_faults("ubatch=1,layer=2")
    assert one == FaultSpec(kind="raise", layer=2, ubatch=1)
    sleep, exit_ = parse_faults(" kind=sleep, seconds=0.5, rank=1, step=12 ; kind=exit,code=7,count=2")
    assert (sleep.kind, sleep.seconds, sleep.rank, sleep.step, sleep.ubatch) == ("sleep", 0.5, 1, 12, None)
    assert (exit_.kind, exit_.code, exit_.count) == ("exit", 7, 2)
    for bad, match in [("kind=explode", "kind"), ("layer=two", "integer"), ("colour=red", "unknown key"),
                       ("layer", "key=value"), ("seconds=soon", "number")]:
        with pytest.raises(ValueError, match=match):
            parse_faults(bad)


def _engine(overlap: bool, step_timeout_s: float = 300.0) -> Engine:
    dbo = OverlapConfig(enable_dbo=True, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0)
    runner = ModelRunner(build_tiny_moe(), overlap=dbo, num_kv_blocks=128, block_size=4)
    return Engine(runner, SchedulerConfig(max_num_seqs=8, overlap_schedule=overlap, step_timeout_s=step_timeout_s))


def _run(engine: Engine, max_steps: int = 200) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if not engine.has_work:
            return outputs
    raise AssertionError("the engine did not finish")


def test_no_variable_installs_nothing(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    engine = _engine(False)
    assert engine.runner.fault_hooks == []
    engine.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_ubatch_fault_fails_that_step_only(monkeypatch, overlap):
    monkeypatch.setenv(ENV_VAR, "ubatch=1,layer=1")
    reference_engine = _engine(overlap)
    reference_engine.runner.fault_hooks[0].remove()
    reference_engine.add_request("ref", PROMPT, GREEDY)
    expected = [t for o in _run(reference_engine)["ref"] for t in o.new_token_ids]
    reference_engine.close()

    engine = _engine(overlap)
    assert len(engine.runner.fault_hooks) == 1
    engine.add_request("hit", PROMPT, GREEDY)
    outputs = _run(engine)
    (failed,) = outputs["hit"]
    assert failed.finish_reason == "error" and "InjectedFault" in failed.error and "ubatch 1" in failed.error
    assert engine.failed_steps == 1 and engine.scheduler.kv_usage == 0
    # It fired once; the engine goes on and gives the same tokens as a clean one.
    engine.add_request("after", PROMPT, GREEDY)
    tokens = [t for o in _run(engine)["after"] for t in o.new_token_ids]
    assert tokens == expected
    engine.close()


def test_a_stuck_forward_is_a_step_timeout(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "kind=sleep,seconds=2,layer=0")
    engine = _engine(True, step_timeout_s=0.5)
    engine.add_request("slow", PROMPT, GREEDY)
    started = time.monotonic()
    with pytest.raises(StepTimeoutError, match="did not finish within 0.5 s"):
        _run(engine)
    assert time.monotonic() - started < 1.9  # raised while the forward still sleeps
    time.sleep(2)  # let the sleeping forward end before the engine goes away
    engine._worker.shutdown(wait=True)
