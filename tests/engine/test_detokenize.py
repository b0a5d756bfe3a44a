"""Incremental detokenization gives exactly the text of decoding the whole output, also
when tokens split UTF-8 characters (byte-level tokenizer)."""

import random

from tandem.models.tiny_moe import build_tokenizer
from tandem.engine.output_processor import OutputProcessor, OutputState


def test_incremental_text_equals_full_decode():
    tokenizer = build_tokenizer()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    processor = OutputProcessor(decode)
    pool = tokenizer.encode("héllo wörld ✓ 😀 ok").ids
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice([rng.randrange(256), rng.choice(pool)]) for _ in range(30)]
        state, output_ids = OutputState(), []
        streamed = ""
        for i, token in enumerate(ids):
            output_ids.append(token)
            processor.detokenize(state, output_ids, final=i == len(ids) - 1)
            assert state.text.startswith(streamed)  # text only ever grows
            streamed = state.text
        assert state.text == decode(ids)
