"""Incremental detokenization gives exactly the text of decoding the whole output, also
when tokens split UTF-8 characters (byte-level tokenizer)."""

import random

from tandem.models.tiny_moe import build_tokenizer
from tandem.worker.future_map import FutureMap
from tandem.worker.kv_cache import BlockAllocator
from tandem.worker.sampling import SamplingParams
from tandem.engine.scheduler import Request, Scheduler


def test_incremental_text_equals_full_decode():
    tokenizer = build_tokenizer()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    scheduler = Scheduler(BlockAllocator(4), 4, FutureMap(4), decode=decode)
    pool = tokenizer.encode("héllo wörld ✓ 😀 ok").ids
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice([rng.randrange(256), rng.choice(pool)]) for _ in range(30)]
        request = Request("r", [1], SamplingParams())
        streamed = ""
        for i, token in enumerate(ids):
            request.output_ids.append(token)
            scheduler._detokenize(request, final=i == len(ids) - 1)
            assert request.text.startswith(streamed)  # text only ever grows
            streamed = request.text
        assert request.text == decode(ids)
