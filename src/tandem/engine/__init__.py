"""The request loop: the engine (normal, overlapped and pipeline loops), the scheduler and
its request state, chunked prefill, outputs, and the offline `generate` entry points."""
