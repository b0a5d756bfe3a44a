"""The sweep `tandem tune` runs when given no sizes, and the margin DBO must win by.

The overlap prior that `serve` and `generate` compute from the simulator
(`simulate.serve_prior`) predicts this same sweep, so it equals the document
`tandem tune --simulate HW` writes. Both the CLI and the simulator import this module, so it
imports nothing: the CLI reads it on every call.
"""

#: Decode batch sizes, in tokens per rank.
DECODE_TOKENS = (8, 16, 32, 64, 128, 256)
#: Prefill sizes, in tokens per rank.
PREFILL_TOKENS = (64, 128, 256, 512, 1024, 2048)
#: Decode: the cached tokens each request attends over.
CONTEXT_LEN = 128
#: Prefill: the new tokens of each request (a batch holds several).
PREFILL_LEN = 512
#: How much faster DBO must be to win a size (0.03 = 3 %).
MARGIN = 0.03


def comma_list(values: tuple[int, ...]) -> str:
    """The sizes as a CLI flag's text (`8,16,32`)."""
    return ",".join(map(str, values))


__all__ = ["CONTEXT_LEN", "DECODE_TOKENS", "MARGIN", "PREFILL_LEN", "PREFILL_TOKENS", "comma_list"]
