"""`tandem serve --overlap-policy auto` as users run it (#31): two gloo ranks with DBO and no
tune file start from the simulator's prediction for this host, measured at start-up; with
`--overlap-prior none` they start from nothing. What the planner got is what rank 0's planner
holds, as its start-up line says."""

from __future__ import annotations

import re

import pytest

from tandem.testing.server_process import Server, complete

AUTO_DP2 = ("tiny-moe", "--data-parallel-size", "2", "--enable-dbo", "--overlap-policy", "auto",
            "--kv-cache-tokens", "4096")


@pytest.mark.slow  # two ranks, and this host measured by two more
def test_auto_starts_from_this_hosts_simulated_prior():
    with Server(*AUTO_DP2) as server:
        answer = complete(server, "Hello", 4)
        output = server.output()
    assert answer.status_code == 200, answer.text
    predicted = re.search(r"auto starts from tandem simulate --hardware here: DBO / none predicted decode 8: "
                          r"([0-9.]+)x.*; prefill 64: ([0-9.]+)x", output)
    assert predicted, output
    assert all(float(ratio) > 0 for ratio in predicted.groups())
    held = re.search(r"the overlap planner starts from a prior simulated on here \(CPU, gloo\) for tiny-moe on 2 ranks: "
                     r"decode (\d+) sizes \(8-256 tokens\), prefill (\d+) sizes \(64-2048 tokens\)", output)
    assert held, output
    assert [int(n) for n in held.groups()] == [6, 6]
    assert "Traceback" not in output


@pytest.mark.slow  # two ranks
def test_overlap_prior_none_starts_from_nothing():
    with Server(*AUTO_DP2, "--overlap-prior", "none") as server:
        output = server.output()
    assert "the overlap planner starts with no prior (the static thresholds until it has measured)" in output, output
    assert "measuring this host" not in output and "auto starts from" not in output
