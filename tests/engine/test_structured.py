"""Constrained decoding in the engine (tiny-moe): the grammar state lives with the request, so
the overlapped and the normal loop, with and without preemption, give the same JSON, every
reply validates and ends with "stop", and unconstrained requests in the same steps keep the
tokens they get alone."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.config import OverlapConfig, SchedulerConfig
from tandem.models.tiny_moe import build_tiny_moe
from tandem.engine.core import Engine
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
}
PROMPTS = ["A person:", "Another one, with a much longer prompt than the first one has", "x", "Who?"]


def _params(i: int) -> SamplingParams:
    if i == 2:  # an unconstrained neighbour
        return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    sampled = dict(temperature=1.0, seed=i) if i % 2 else dict(temperature=0)
    return SamplingParams(max_tokens=80, json_schema=json.dumps(SCHEMA), **sampled)


def _run(overlap: bool, num_kv_blocks: int, which=range(len(PROMPTS))) -> tuple[dict, int]:
    info = build_tiny_moe()
    runner = ModelRunner(info, overlap=OverlapConfig(), num_kv_blocks=num_kv_blocks, block_size=4)
    engine = Engine(runner, SchedulerConfig(max_num_seqs=8, overlap_schedule=overlap), max_num_batched_tokens=32)
    for i in which:
        assert engine.add_request(f"r{i}", info.tokenizer.encode(PROMPTS[i]).ids, _params(i)) is None
    outputs = {f"r{i}": ["", None] for i in which}
    for _ in range(3000):
        for out in engine.step():
            outputs[out.request_id][0] += out.new_text
            outputs[out.request_id][1] = out.finish_reason
        if not engine.has_work:
            break
    preemptions = engine.scheduler.num_preemptions
    engine.close()
    return outputs, preemptions


@pytest.mark.parametrize("num_kv_blocks", [256, 48], ids=["roomy", "preempting"])
def test_constrained_replies_validate_and_match_across_loops(num_kv_blocks):
    normal, _ = _run(False, num_kv_blocks)
    overlapped, preemptions = _run(True, num_kv_blocks)
    if num_kv_blocks < 256:
        assert preemptions > 0
    assert overlapped == normal
    for rid, (text, reason) in normal.items():
        if rid == "r2":
            assert reason == "length"
            continue
        assert reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_an_unconstrained_request_is_unchanged_by_constrained_neighbours():
    alone, _ = _run(True, 256, which=[2])
    together, _ = _run(True, 256)
    assert together["r2"] == alone["r2"]


def test_min_tokens_with_a_schema_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, json_schema=json.dumps(SCHEMA))


@pytest.mark.parametrize("schema, where, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "#", "uniqueItems"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}, "#/properties/n", "multipleOf"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "#/anyOf/1", "not"),
    ({"$defs": {"a": {"if": {"type": "string"}}}, "$ref": "#/$defs/a"}, "#/$defs/a", "if"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "#", "allOf"),
])
def test_keywords_constrained_decoding_would_ignore_are_refused(schema, where, keyword):
    import re

    from tandem.worker.grammar import check_json_schema

    with pytest.raises(ValueError, match=re.escape(f"'{keyword}' (at {where})")):
        check_json_schema(schema)


def test_enforced_keywords_and_properties_named_like_keywords_are_accepted():
    from tandem.worker.grammar import check_json_schema

    check_json_schema({"type": "object", "properties": {"not": {"type": "integer", "multipleOf": 3},
                                                        "if": {"oneOf": [{"const": 1}, {"const": 2}]}}})


def test_length_bounded_strings_never_hold_raw_control_characters():
    """xgrammar 0.2 lets raw control characters into strings with minLength/maxLength (invalid
    JSON); the grammar tandem compiles does not. Random walks through the masks, seeded."""
    import random

    import torch

    from tandem.models.tiny_moe import EOS_ID, build_tokenizer
    from tandem.worker.grammar import GrammarCompiler

    tokenizer = build_tokenizer()
    compiler = GrammarCompiler(tokenizer, [EOS_ID])
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 4}},
                         "required": ["s"]})
    pick = random.Random(0)
    for _ in range(100):
        constraint = compiler.constraint(schema)
        bitmask = torch.full((1, -(-constraint.vocab_size // 32)), -1, dtype=torch.int32)
        out = []
        while not constraint.terminated:
            constraint.fill(bitmask, 0)
            allowed = ((bitmask[0][:, None] >> torch.arange(32)) & 1).flatten()[: constraint.vocab_size].nonzero()
            token = int(allowed[pick.randrange(len(allowed))])
            constraint.advance(token)
            out.append(token)
        assert out[-1] == EOS_ID and not any(t < 0x20 for t in out)
        assert isinstance(json.loads(tokenizer.decode(out[:-1]))["s"], str)


def test_the_compiled_grammar_cache_stays_within_its_bound_in_real_memory():
    """Distinct schemas, one after another (an agent's per-call tool schemas): the compiled
    grammars the rank keeps stay under `--grammar-cache-mb` as the allocator counts them, oldest
    out first, and a repeated schema is served from the cache. xgrammar's own cache counted
    about 1 KB for a grammar that holds 24 KB, so its '1 MB' kept 9 MB here and its default
    512 MB would have kept gigabytes; a grammar's own `memory_size_bytes` alone kept 1.3 MB."""
    import json

    from tandem.models.tiny_moe import EOS_ID, build_tokenizer
    from tandem.platform.memory_probe import malloc_in_use_bytes
    from tandem.worker.grammar import GrammarCompiler

    compiler = GrammarCompiler(build_tokenizer(), [EOS_ID], cache_mb=1)
    compiler.constraint(json.dumps({"type": "object"}))  # build the compiler before measuring
    before = malloc_in_use_bytes()
    sizes = []
    for i in range(400):
        schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "string"} for j in range(3)}}
        compiler.constraint(json.dumps(schema))
        sizes.append(compiler.cache_bytes)
    grown = malloc_in_use_bytes() - before
    assert max(sizes) <= 1 << 20 and sizes[-1] > (1 << 20) // 2
    assert grown < 1.2 * (1 << 20), f"{grown / 2**20:.2f} MB held for a 1 MB cache"
    compiles = compiler.compiles
    compiler.constraint(json.dumps(schema))  # the newest is still cached
    assert compiler.compiles == compiles and compiler.cache_limit_bytes == 1 << 20
    first = {"type": "object", "properties": {f"field_0_{j}": {"type": "string"} for j in range(3)}}
    compiler.constraint(json.dumps(first))  # long evicted: compiled again
    assert compiler.compiles == compiles + 1


def test_ids_past_the_tokenizer_are_masked_even_inside_the_bitmask_s_last_word():
    """tiny-moe's tokenizer has 258 ids and its head 320: the bitmask's 9 words cover ids up
    to 287. Inside a JSON string (most tokens allowed) xgrammar sets every bit but the
    rejected ones, the 30 past its vocabulary included; a constrained request then sampled
    id 281, which the grammar refused (a 500 in the soak's adversarial waves)."""
    import json

    import torch

    from tandem.models.tiny_moe import EOS_ID, build_tokenizer
    from tandem.worker.grammar import GrammarCompiler, mask_logits

    tokenizer = build_tokenizer()
    compiler = GrammarCompiler(tokenizer, [EOS_ID], cache_mb=1)
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    constraint = compiler.constraint(json.dumps(schema))
    assert constraint.vocab_size == 258
    for token in tokenizer.encode('{"s": "').ids:
        constraint.advance(token)
    logits = torch.zeros(2, 320)
    logits[:, 258:] = 50.0  # a padded head that favours the ids no tokenizer has
    mask_logits(logits, [1], [constraint])
    assert (logits[1, 258:] == float("-inf")).all()
    assert logits[1].argmax() < 258 and int((logits[1] == 0).sum()) > 100  # the string's characters stay
    assert (logits[0, 258:] == 50).all()  # the unconstrained row is left alone


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlapped"])
def test_a_grammar_that_refuses_its_token_fails_only_its_request(monkeypatch, overlap):
    """Should a grammar refuse the token the step sampled under its own mask (the padded-head
    bug above did), that request ends with an error and the step's other requests, constrained
    or not, go on: before, the whole step's requests failed."""
    from tandem.worker import grammar

    real_advance = grammar.GrammarConstraint.advance
    seen: dict[int, int] = {}

    def refuse_third(self, token):
        seen[id(self)] = seen.get(id(self), 0) + 1
        if self is victim[0] and seen[id(self)] == 3:
            token = 10_000  # no grammar accepts this id
        real_advance(self, token)

    victim = []
    real_constraint = grammar.GrammarCompiler.constraint

    def constraint(self, json_schema):
        made = real_constraint(self, json_schema)
        if not victim:
            victim.append(made)
        return made

    monkeypatch.setattr(grammar.GrammarConstraint, "advance", refuse_third)
    monkeypatch.setattr(grammar.GrammarCompiler, "constraint", constraint)
    alone, _ = _run(overlap, 256, which=[1, 2, 3])
    monkeypatch.setattr(grammar.GrammarConstraint, "advance", real_advance)
    reference, _ = _run(overlap, 256, which=[1, 2, 3])
    assert alone["r1"][1] == "error"
    assert alone["r2"] == reference["r2"] and alone["r3"] == reference["r3"]
    assert reference["r3"][1] == "stop"
