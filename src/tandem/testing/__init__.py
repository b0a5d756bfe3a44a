"""Test support shipped with the package: multi-process gloo launchers (and, later, the
CPU emulations of GPU-only libraries)."""

from tandem.testing.distributed import DistributedTestError, find_free_port, run_distributed

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]
