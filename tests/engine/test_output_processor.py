"""The output processor's contract, on a real scheduler with no model: the scheduler applies
tokens and token-level stops, the processor turns them into text deltas, finds stop strings
(over a token-level "length"), holds back what could still become one, and keeps no state
for a request once its last delta is out."""

from tandem.engine.output_processor import OutputProcessor
from tandem.engine.outputs import RequestOutput
from tandem.engine.scheduler import Request, Scheduler
from tandem.worker.future_map import FutureMap
from tandem.worker.kv_cache import BlockAllocator
from tandem.worker.sampling import SamplingParams

LETTERS = "_abcdefgh"  # token id i decodes to LETTERS[i]; 0 is the end token


def _decode(ids: list[int]) -> str:
    return "".join(LETTERS[i] for i in ids)


def _engine_parts(max_model_len: int = 64):
    scheduler = Scheduler(BlockAllocator(32), 4, FutureMap(4), max_model_len=max_model_len, eos_token_ids={0})
    return scheduler, OutputProcessor(_decode)


def _add(scheduler, processor, request_id: str, params: SamplingParams) -> Request:
    request = Request(request_id, [1, 2], params)
    scheduler.add_request(request)
    processor.add_request(request_id)
    return request


def _run_step(scheduler, processor, token: int) -> list[RequestOutput]:
    """One normal (not overlapped) step in which every scheduled request samples `token`;
    finishes what its output ends, as the engine does."""
    step = scheduler.schedule()
    outputs = []
    for update in scheduler.apply(step, [token] * len(step.scheduled)):
        output = processor.process(update)
        if output is not None:
            if output.finished:
                scheduler.finish(update.request, output.finish_reason)
            outputs.append(output)
    return outputs


def test_stop_string_is_held_back_then_cut_and_wins_over_length():
    scheduler, processor = _engine_parts()
    request = _add(scheduler, processor, "r", SamplingParams(max_tokens=3, stop=["bc"]))
    first = _run_step(scheduler, processor, 1)  # "a"
    assert [(o.new_text, o.finished) for o in first] == [("", False)]  # the last character is held (len("bc") - 1)
    second = _run_step(scheduler, processor, 2)  # "ab": "b" may start the stop string
    assert [(o.new_text, o.finished) for o in second] == [("a", False)]
    last = _run_step(scheduler, processor, 3)  # "abc": the stop string, on the max_tokens-th token
    assert [(o.new_text, o.finished, o.finish_reason) for o in last] == [("", True, "stop")]
    assert [o.new_token_ids for o in first + second + last] == [[1], [2], [3]]
    assert request.finished and request.finish_reason == "stop" and request.blocks == []
    assert processor.states == {}


def test_end_token_is_dropped_and_length_finishes():
    scheduler, processor = _engine_parts()
    _add(scheduler, processor, "eos", SamplingParams(max_tokens=8))
    _add(scheduler, processor, "long", SamplingParams(max_tokens=2, ignore_eos=True))
    outputs = _run_step(scheduler, processor, 0) + _run_step(scheduler, processor, 4)
    by_id = {(o.request_id, o.finish_reason): o for o in outputs if o.finished}
    eos = by_id["eos", "stop"]
    assert (eos.new_token_ids, eos.num_output_tokens, len(eos.token_times)) == ([], 0, 1)
    long = by_id["long", "length"]
    assert long.num_output_tokens == 2 and long.new_text == "d"
    assert not scheduler.has_unfinished and processor.states == {}


def test_abort_gives_the_last_delta_with_held_back_text():
    scheduler, processor = _engine_parts()
    request = _add(scheduler, processor, "r", SamplingParams(max_tokens=8, stop=["xyz"]))
    assert _run_step(scheduler, processor, 1)[0].new_text == ""  # "a" held: it is shorter than the stop string
    assert scheduler.abort("r") is request and scheduler.abort("r") is None
    last = processor.finish(request, "abort")
    assert (last.new_text, last.finished, last.finish_reason, last.new_token_ids) == ("a", True, "abort", [])
    assert processor.states == {}


def test_one_constructor_for_error_outputs():
    output = RequestOutput.failed("r", "boom", num_prompt_tokens=3, num_output_tokens=1)
    assert (output.finished, output.finish_reason, output.error) == (True, "error", "boom")
    assert (output.new_token_ids, output.new_text, output.num_prompt_tokens, output.num_output_tokens) == ([], "", 3, 1)
