"""The overlap planner on synthetic counters: fit, predict, choice, exploration bounds."""

import json
import math
import random

import pytest

from tandem.ubatch.planner import (
    MAX_EXPLORE_SHARE,
    OverlapPlanner,
    StepMeasurement,
    StepShape,
    TunePrior,
    overlap_choices,
)

CHOICES = overlap_choices(3, dbo=True, sbo=False)  # none, dbo-2, dbo-3


def true_times(choice, shape):
    """A synthetic rank: compute 2 ms + 20 µs/token + 1 ns/attention pair, link 1 ms +
    15 µs/token, splitting costs 0.4 ms per extra ubatch, 50 µs of switches."""
    compute = 2e-3 + 20e-6 * shape.num_tokens + 1e-9 * shape.attention
    comm = 1e-3 + 15e-6 * shape.num_tokens
    k = choice.num_ubatches
    if k == 1:
        return StepMeasurement(compute + comm, compute, comm, 0.0)
    compute_k, switch = compute + 0.4e-3 * (k - 1), 50e-6
    comm_k = comm + (k - 1) * 1e-3
    step = max(compute_k + switch, comm_k) + min(compute_k + switch, comm_k) / k
    return StepMeasurement(step, compute_k, comm_k, switch)


def shapes(n, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        tokens = rng.choice([8, 16, 32, 64, 128, 256, 512])
        yield StepShape(tokens, attention=tokens * rng.choice([64, 512, 4096]), decode=True)


def run(planner, steps, seed=0):
    taken = []
    for shape in shapes(steps, seed):
        predicted = planner.predict(shape)
        feasible = [c.num_ubatches <= shape.num_tokens for c in planner.choices]
        planned = planner.choose(predicted, feasible, fallback=planner.choices[0])
        planner.observe(planned, shape, true_times(planned.choice, shape))
        taken.append((shape, planned))
    return taken


def test_fit_predicts_every_choice_after_training():
    planner = OverlapPlanner(CHOICES, explore_share=0.05, seed=1)
    run(planner, 600)
    for shape in [StepShape(16, 16 * 512), StepShape(200, 200 * 64), StepShape(512, 512 * 4096)]:
        for choice, predicted in zip(CHOICES, planner.predict(shape)):
            assert predicted == pytest.approx(true_times(choice, shape).step_s, rel=0.05), (choice.name, shape)


def test_choice_is_the_fastest_once_trained():
    planner = OverlapPlanner(CHOICES, explore_share=0.0, seed=1)
    planner.explore_share = 0.05
    run(planner, 600)
    planner.explore_share = 0.0
    for planned_shape, planned in run(planner, 200, seed=5):
        best = min(CHOICES, key=lambda c: true_times(c, planned_shape).step_s)
        chosen = true_times(planned.choice, planned_shape).step_s
        assert chosen <= true_times(best, planned_shape).step_s * 1.02, (planned_shape, planned.choice.name, best.name)
    # Small steps run unsplit, large ones split: both regimes exist in this synthetic rank.
    small, large = StepShape(8, 8 * 64), StepShape(512, 512 * 64)
    pick = lambda s: CHOICES[min(range(3), key=lambda i: planner.predict(s)[i])].name  # noqa: E731
    assert pick(small) == "none" and pick(large).startswith("dbo")


def test_exploration_is_bounded_seeded_and_identical_across_ranks():
    a, b = OverlapPlanner(CHOICES, explore_share=0.05, seed=7), OverlapPlanner(CHOICES, explore_share=0.05, seed=7)
    agreed = [0.0010, 0.0012, 0.0014]
    steps_a = [a.choose(agreed, [True] * 3, CHOICES[0]) for _ in range(4000)]
    steps_b = [b.choose(agreed, [True] * 3, CHOICES[0]) for _ in range(4000)]
    assert steps_a == steps_b
    explored = sum(s.explored for s in steps_a) / len(steps_a)
    assert 0.03 < explored <= MAX_EXPLORE_SHARE + 0.01
    assert {s.choice.name for s in steps_a if s.explored} == {"dbo-2", "dbo-3"}
    assert all(s.choice.name == "none" for s in steps_a if not s.explored)
    with pytest.raises(ValueError, match="explore share"):
        OverlapPlanner(CHOICES, explore_share=0.06)


def test_infeasible_choices_are_never_taken_and_unknown_ones_fall_back():
    planner = OverlapPlanner(CHOICES, explore_share=0.05)
    for _ in range(500):
        step = planner.choose([0.003, 0.001, 0.0005], [True, True, False], CHOICES[0])
        assert step.choice.name != "dbo-3"
    fresh = OverlapPlanner(CHOICES, explore_share=0.0)
    assert fresh.predict(StepShape(64)) == [math.inf] * 3
    assert fresh.choose([math.inf] * 3, [True] * 3, CHOICES[1]).choice.name == "dbo-2"


def test_tune_file_is_the_prior_until_the_fit_has_data(tmp_path):
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({
        "dbo_decode_token_threshold": 64, "dbo_prefill_token_threshold": 512, "config": {"num_ubatches": 2},
        "sweep": {"decode": [{"tokens_per_rank": 32, "none_ms": 4.0, "dbo_ms": 5.0},
                             {"tokens_per_rank": 128, "none_ms": 8.0, "dbo_ms": 6.0}],
                  "prefill": [{"tokens_per_rank": 512, "none_ms": 20.0, "dbo_ms": 15.0}]},
    }))
    planner = OverlapPlanner(overlap_choices(3, dbo=True, sbo=False), prior=TunePrior.from_file(path))
    none, dbo2, dbo3 = planner.predict(StepShape(80, decode=True))
    assert (none, dbo2, dbo3) == (pytest.approx(0.006), pytest.approx(0.0055), math.inf)
    assert planner.predict(StepShape(1024, decode=False))[:2] == [pytest.approx(0.040), pytest.approx(0.030)]
    with pytest.raises(ValueError, match="sweep"):
        (tmp_path / "bad.json").write_text("{}")
        TunePrior.from_file(tmp_path / "bad.json")


def test_stats_count_choices_and_prediction_error():
    planner = OverlapPlanner(CHOICES, explore_share=0.05, seed=3)
    taken = run(planner, 300)
    stats = planner.stats
    assert sum(stats.choices.values()) == 300
    assert stats.explored_steps == sum(p.explored for _, p in taken)
    assert 0 < stats.predicted_steps < 300
    assert stats.abs_error_s / stats.predicted_steps < 0.2 * stats.measured_s / stats.predicted_steps


def test_sbo_is_a_choice_only_when_enabled():
    assert [c.name for c in overlap_choices(2, dbo=True, sbo=True)] == ["none", "sbo", "dbo-2"]
    assert [c.name for c in overlap_choices(4, dbo=False, sbo=False)] == ["none"]
    with pytest.raises(ValueError, match="no overlap"):
        OverlapPlanner(overlap_choices(2, dbo=True, sbo=False)[1:])


def test_attention_price_is_learnt_even_when_every_step_is_split():
    from tandem.ubatch.planner import OverlapCostModel

    model = OverlapCostModel(CHOICES)
    assert model.attention_weight is None
    dbo = CHOICES[1]
    for shape in shapes(50):
        model.observe(dbo, shape, true_times(dbo, shape))
    # 1 ns per pair over 20 µs per token (the split's fixed cost is not per token).
    assert model.attention_weight == pytest.approx(1e-9 / 20e-6, rel=0.05)


def test_decide_drops_choices_whose_last_ubatch_would_be_padding():
    from tandem.ubatch import coordinate_ubatching

    planner = OverlapPlanner(CHOICES, explore_share=0.0)
    # 5 tokens on this rank, padded to 9 by a peer: 3 ubatches of 3 leave it none in the last.
    decision = coordinate_ubatching(5, True, num_ubatches=3, predicted_s=[0.003, 0.002, 0.001])
    decision = type(decision)(decision.should_ubatch, 9, [5, 9], decision.predicted_s)
    assert not decision.fits(3) and decision.fits(2)
    assert planner.decide(decision, 1, [0.003, 0.002, 0.001]).choice.name == "dbo-2"
    assert planner.static_choice(3).name == "dbo-3" and planner.static_choice(1).name == "none"


def test_correction_learns_what_the_structure_gets_wrong_including_steps_before_the_fit():
    """A rank whose DBO steps report most of their time as compute (the transport's CPU
    work hidden under it): the structure then overprices DBO; the measured ratios fix it."""

    def misfit(choice, shape):
        plain = true_times(CHOICES[0], shape)
        if choice.num_ubatches == 1:
            return plain
        step = 0.65 * plain.step_s + 1e-3
        return StepMeasurement(step, step * 0.95, plain.comm_s, step * 0.02)

    planner = OverlapPlanner(CHOICES[:2], explore_share=0.03, seed=2)
    for shape in shapes(200, seed=3):
        predicted = planner.predict(shape)
        static = planner.static_choice(2 if shape.num_tokens >= 32 else 1)  # the thresholds until it is ready
        planned = planner.choose(predicted, [True, True], static)
        planner.observe(planned, shape, misfit(planned.choice, shape))
    for tokens in (128, 256, 512):
        none, dbo = planner.predict(StepShape(tokens, tokens * 512))
        assert dbo < none
        assert dbo == pytest.approx(misfit(CHOICES[1], StepShape(tokens, tokens * 512)).step_s, rel=0.1)


def test_exploration_stays_within_budget_at_every_step_and_revisits_stale_choices_per_size():
    planner = OverlapPlanner(CHOICES, explore_share=0.05)
    explored, runs = 0, {}
    for step in range(2000):
        key = step % 2
        planned = planner.choose([0.0010, 0.0012, 0.0014], [True] * 3, CHOICES[0], size_key=key)
        explored += planned.explored
        assert explored <= 0.05 * (step + 1)
        if planned.explored:
            runs.setdefault(key, []).append(planned.choice.name)
    assert explored >= 0.045 * 2000
    # Each size class explores both alternatives, the longest unrun first (so they alternate).
    for names in runs.values():
        assert set(names) == {"dbo-2", "dbo-3"}
        assert all(a != b for a, b in zip(names, names[1:]))


def test_a_choice_predicted_far_slower_is_not_explored():
    planner = OverlapPlanner(CHOICES, explore_share=0.05)
    steps = [planner.choose([0.001, 0.0014, 0.0016], [True] * 3, CHOICES[0]) for _ in range(1000)]
    assert {s.choice.name for s in steps if s.explored} == {"dbo-2"}
    unknown = OverlapPlanner(CHOICES, explore_share=0.05)
    steps = [unknown.choose([math.inf] * 3, [True] * 3, CHOICES[0]) for _ in range(1000)]
    assert {s.choice.name for s in steps if s.explored} == {"dbo-2", "dbo-3"}  # nothing known: all plausible


def test_the_prior_holds_for_a_choice_the_fit_has_not_measured(tmp_path):
    """Four unsplit steps make the fit ready; it knows nothing of a split's cost, so alone it
    would pick DBO at 32 tokens (3.88 ms predicted against 4.12 ms measured unsplit, where a
    real DBO step takes 4.33 ms). With a prior that says DBO is 1.25x no overlap there, the
    unmeasured DBO keeps that verdict, scaled to the fitted unsplit step, until a DBO step runs."""
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({
        "dbo_decode_token_threshold": 2**31 - 1, "dbo_prefill_token_threshold": 2**31 - 1, "config": {"num_ubatches": 2},
        "sweep": {"decode": [{"tokens_per_rank": 32, "none_ms": 4.0, "dbo_ms": 5.0}], "prefill": []},
    }))
    shape = StepShape(32, decode=True)
    with_prior = OverlapPlanner(CHOICES, explore_share=0.0, prior=TunePrior.from_file(path))
    without = OverlapPlanner(CHOICES, explore_share=0.0)
    for planner in (with_prior, without):
        for tokens in (16, 32, 64, 128):
            unsplit = StepShape(tokens, decode=True)
            planned = planner.choose([1.0, 2.0, 2.0], [True] * 3, CHOICES[0])
            planner.observe(planned, unsplit, true_times(CHOICES[0], unsplit))
    none_s, dbo2_s, dbo3_s = without.predict(shape)
    assert none_s == pytest.approx(4.12e-3, rel=1e-3) and dbo2_s == pytest.approx(3.88e-3, rel=1e-3)
    assert without.choose([none_s, dbo2_s, dbo3_s], [True] * 3, CHOICES[0]).choice.name == "dbo-2"

    predicted = with_prior.predict(shape)
    # dbo-2 keeps the prior's ratio; dbo-3, which the prior does not price, is the fit's.
    assert predicted == [pytest.approx(none_s), pytest.approx(none_s * 1.25), pytest.approx(dbo3_s)]
    assert none_s * 1.25 == pytest.approx(5.15e-3, rel=1e-3)
    assert with_prior.choose(predicted, [True, True, False], CHOICES[0]).choice.name == "none"
    forced = with_prior.choose(predicted, [False, True, False], CHOICES[0])
    with_prior.observe(forced, shape, true_times(CHOICES[1], shape))
    assert with_prior.predict(shape)[1] == pytest.approx(with_prior.model.predict(CHOICES[1], shape))
