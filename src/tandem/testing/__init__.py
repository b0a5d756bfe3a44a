"""Test support shipped with the package, apart from the runtime: multi-process gloo
launchers, CPU emulations of GPU-only libraries (`fake_deep_ep`, `fake_deep_gemm`), a load
generator (`load`) and a greedy model harness (`model_harness`). It may import any part of
tandem; no runtime module imports it (tests/test_layering.py checks)."""

from tandem.testing.distributed import DistributedTestError, find_free_port, run_distributed

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]
