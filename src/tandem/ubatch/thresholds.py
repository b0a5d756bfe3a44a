"""When is a batch big enough that splitting it into ubatches pays off."""


def check_ubatch_thresholds(
    num_tokens: int, uniform_decode: bool, decode_threshold: int, prefill_threshold: int
) -> bool:
    """A uniform-decode batch (every request has the same query length) is ubatched from
    `decode_threshold` tokens, any other batch from `prefill_threshold` tokens."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
    return num_tokens >= (decode_threshold if uniform_decode else prefill_threshold)
