"""A rank's `auto` planner starts from the prior its config carries (#31): the simulated
document the command computed (`OverlapConfig.simulated_prior`) read as a tune file's sweep is
read, a thresholds file before it, and nothing when neither is there; the start-up line says
which."""

from __future__ import annotations

import json

from tandem.config import OverlapConfig
from tandem.simulate.hardware import load_hardware
from tandem.simulate.prior import simulated_tune
from tandem.ubatch.planner import StepShape, TunePrior, overlap_choices
from tandem.worker.planner_cache import PlannerCache, describe_prior, prior_source, starting_prior

GRIDS = {"decode": [8, 64], "prefill": [64, 512]}
CONTEXTS = {"decode": 128, "prefill": 512}


def _document() -> dict:
    return simulated_tune("tiny-moe", load_hardware("h200"), ranks=2, num_ubatches=2, grids=GRIDS, contexts=CONTEXTS,
                          margin=0.03)[1]


def _auto(**over) -> OverlapConfig:
    return OverlapConfig(enable_dbo=True, overlap_policy="auto", **over)


def test_the_simulated_document_is_read_as_the_tune_file_holding_it(tmp_path):
    document = _document()
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(document))
    from_config, from_file = starting_prior(_auto(simulated_prior=document)), TunePrior.from_file(path)
    assert from_config == from_file and from_config.tables["decode"][0][0] == 8
    none, dbo = overlap_choices(2, dbo=True, sbo=False)
    assert from_config.predict(dbo, StepShape(8)) > from_config.predict(none, StepShape(8)) > 0


def test_a_thresholds_file_comes_before_the_simulated_prior(tmp_path):
    tuned = tmp_path / "tuned.json"
    measured = {**_document(), "sweep": {"decode": [{"tokens_per_rank": 4, "none_ms": 1.0, "dbo_ms": 0.5}]}}
    tuned.write_text(json.dumps(measured))
    overlap = _auto(thresholds_file=str(tuned), simulated_prior=_document())
    assert starting_prior(overlap).tables == {"decode": [(4, 1e-3, 5e-4)]}
    assert prior_source(overlap) == f"the tune file {tuned}"
    assert starting_prior(_auto()) is None and prior_source(_auto()) is None


def test_the_rank_keeps_one_planner_per_prior_and_says_what_it_starts_from():
    cache, document = PlannerCache(), _document()
    overlap = _auto(simulated_prior=document)
    planner = cache.planner(overlap, sbo=False)
    assert planner is cache.planner(overlap, sbo=False)
    assert planner.prior == starting_prior(overlap)
    assert describe_prior(planner, overlap) == (
        "the overlap planner starts from a prior simulated on H200 for tiny-moe on 2 ranks: "
        "decode 2 sizes (8-64 tokens), prefill 2 sizes (64-512 tokens)")
    bare = cache.planner(_auto(), sbo=False)
    assert bare is not planner and bare.prior is None
    assert describe_prior(bare, _auto()) == (
        "the overlap planner starts with no prior (the static thresholds until it has measured)")


def test_a_planner_that_only_observes_takes_no_prior_and_says_nothing():
    overlap = OverlapConfig(enable_dbo=True, ubatch_split="balanced-cost", simulated_prior=_document())
    planner = PlannerCache().planner(overlap, sbo=False)
    assert planner.prior is None and describe_prior(planner, overlap) is None
    assert describe_prior(None, _auto()) is None
