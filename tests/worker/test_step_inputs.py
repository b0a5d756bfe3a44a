"""`build_step_inputs` builds a whole step with a handful of tensor ops; its tensors equal
those of the request-by-request definition for prefill chunks, decodes, padding and an empty
step, and a request without enough KV blocks is refused."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.worker.step_inputs import ScheduledChunk, build_step_inputs


def _by_request(chunks, block_size: int, padded: int) -> dict:
    """The definition, one request at a time."""
    input_ids, positions, slots = [0] * padded, [0] * padded, [-1] * padded
    max_blocks = max((len(c.block_ids) for c in chunks), default=0)
    table = [list(c.block_ids) + [0] * (max(max_blocks, 1) - len(c.block_ids)) for c in chunks]
    start = 0
    for chunk in chunks:
        for i, token in enumerate(chunk.token_ids):
            position = chunk.num_computed + i
            input_ids[start + i], positions[start + i] = token, position
            slots[start + i] = chunk.block_ids[position // block_size] * block_size + position % block_size
        start += len(chunk.token_ids)
    counts = [len(c.token_ids) for c in chunks]
    return {"input_ids": input_ids, "positions": positions, "slot_mapping": slots, "block_table": table,
            "seq_lens": [c.num_computed + n for c, n in zip(chunks, counts)],
            "query_start_loc": [sum(counts[:r]) for r in range(len(counts) + 1)]}


def _random_chunks(rng: random.Random, block_size: int) -> list[ScheduledChunk]:
    chunks, next_block = [], 0
    for _ in range(rng.randint(1, 9)):
        computed, new = rng.randint(0, 40), rng.choice([1, 1, 1, rng.randint(1, 30)])
        num_blocks = -(-(computed + new) // block_size) + rng.randint(0, 2)
        blocks = list(range(next_block, next_block + num_blocks))
        rng.shuffle(blocks)
        next_block += num_blocks
        chunks.append(ScheduledChunk([rng.randint(0, 250) for _ in range(new)], computed, blocks))
    return chunks


@pytest.mark.parametrize("seed", range(20))
def test_step_tensors_equal_the_request_by_request_definition(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    chunks = _random_chunks(rng, block_size)
    total = sum(len(c.token_ids) for c in chunks)
    padded = total + rng.choice([0, 0, 3])
    inputs = build_step_inputs(chunks, block_size, padded)
    want = _by_request(chunks, block_size, padded)
    meta = inputs.attn_metadata
    assert inputs.input_ids.tolist() == want["input_ids"]
    assert inputs.positions.tolist() == want["positions"]
    assert meta.slot_mapping.tolist() == want["slot_mapping"]
    assert meta.block_table.tolist() == want["block_table"] and meta.block_table.dtype == torch.int32
    assert meta.seq_lens.tolist() == want["seq_lens"] == list(meta.seq_lens_host)
    assert meta.query_start_loc.tolist() == want["query_start_loc"] == list(meta.query_start_loc_host)
    assert meta.decode_only == all(len(c.token_ids) == 1 for c in chunks)
    assert inputs.num_scheduled_tokens == [len(c.token_ids) for c in chunks]


def test_an_empty_step_is_all_padding():
    inputs = build_step_inputs([], 4, 3)
    assert inputs.input_ids.tolist() == [0, 0, 0] and inputs.attn_metadata.slot_mapping.tolist() == [-1, -1, -1]
    assert inputs.attn_metadata.block_table.shape == (0, 1) and inputs.attn_metadata.query_start_loc.tolist() == [0]


def test_too_few_blocks_and_too_little_padding_are_refused():
    with pytest.raises(ValueError, match="request 1 needs 9 cached tokens but has 2 blocks of 4"):
        build_step_inputs([ScheduledChunk([1], 0, [0]), ScheduledChunk([2], 8, [1, 2])], 4)
    with pytest.raises(ValueError, match="smaller than the 2 scheduled tokens"):
        build_step_inputs([ScheduledChunk([1, 2], 0, [0])], 4, 1)
