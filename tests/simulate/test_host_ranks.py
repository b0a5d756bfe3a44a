"""The gloo ranks' harness (`simulate.host_ranks.run_ranks`): one deadline for all ranks, the
first rank that fails reported with its own stderr, every rank killed on the way out. Pinned on
plain interpreters standing in for ranks (no torch, no gloo)."""

from __future__ import annotations

import os
import sys

import pytest

from tandem.simulate.host_ranks import run_ranks


def _ranks(*scripts: str) -> tuple[list[list[str]], list[dict[str, str]]]:
    return [[sys.executable, "-c", s] for s in scripts], [dict(os.environ) for _ in scripts]


def test_every_ranks_output_comes_back_when_all_succeed():
    argvs, envs = _ranks("print('zero')", "print('one')")
    assert run_ranks(argvs, envs, timeout_s=60, what="probe") == ["zero\n", "one\n"]


def test_a_later_rank_that_fails_first_is_reported_with_its_own_stderr():
    # Rank 0 outlives rank 1 (as a gloo peer waits on its timeout) after more stderr than a pipe holds.
    rank0 = "import sys, time; sys.stderr.write('noise' * 100000); sys.stderr.flush(); time.sleep(60)"
    argvs, envs = _ranks(rank0, "import sys; sys.stderr.write('rank one broke'); sys.exit(3)")
    with pytest.raises(RuntimeError, match=r"probe: rank 1 failed first \(exit 3\):\nrank one broke"):
        run_ranks(argvs, envs, timeout_s=60, what="probe")


def test_one_deadline_for_all_ranks_and_the_ranks_still_running_are_named():
    argvs, envs = _ranks("print('done')", "import time; time.sleep(60)", "import time; time.sleep(60)")
    with pytest.raises(RuntimeError, match=r"probe did not finish within 1 s \(ranks \[1, 2\] still running\)"):
        run_ranks(argvs, envs, timeout_s=1, what="probe")
