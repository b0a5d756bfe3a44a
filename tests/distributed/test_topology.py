"""World = PP x DP: rank layout, the ring between stages, and layer partitions."""

from __future__ import annotations

import pytest

from tandem.distributed import StageLayers, Topology, partition_layers, stage_layers


def test_ranks_are_stage_major_and_the_ring_closes():
    topo = Topology(pipeline_parallel_size=3, data_parallel_size=2)
    assert topo.world_size == 6
    assert [topo.stage_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [topo.dp_rank_of(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert topo.stage_ranks(1) == [2, 3]
    assert [topo.next_rank(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [topo.prev_rank(r) for r in range(6)] == [4, 5, 0, 1, 2, 3]
    assert topo.describe(3) == "rank 3 (pipeline stage 1, dp rank 1)"
    assert Topology(1, 2).describe(1) == "rank 1"
    with pytest.raises(ValueError, match="outside a world of 6"):
        topo.stage_of(6)
    with pytest.raises(ValueError, match="pipeline-parallel-size"):
        Topology(0, 1)


def test_even_partition_gives_the_remainder_to_stages_before_the_last():
    assert partition_layers(3, 2) == [(0, 2), (2, 3)]
    assert partition_layers(7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert partition_layers(24, 2, [10, 14]) == [(0, 10), (10, 24)]
    assert stage_layers(3, 1, 2) == StageLayers(2, 3, is_first=False, is_last=True)


@pytest.mark.parametrize(
    "layers, stages, partition, message",
    [(2, 3, None, "fewer than the 3"), (4, 2, [1, 2], "sum to the model's 4"), (4, 2, [4], "1 entries for 2"), (4, 2, [0, 4], "at least one")],
)
def test_bad_partitions_are_named(layers, stages, partition, message):
    with pytest.raises(ValueError, match=message):
        partition_layers(layers, stages, partition)


def test_stage_owns_its_checkpoint_tensors():
    first, last = StageLayers(0, 2, True, False), StageLayers(2, 3, False, True)
    assert first.owns_checkpoint_tensor("model.layers.1.mlp.gate.weight", tied=False)
    assert not first.owns_checkpoint_tensor("model.layers.2.mlp.gate.weight", tied=False)
    assert first.owns_checkpoint_tensor("model.embed_tokens.weight", tied=False)
    assert not first.owns_checkpoint_tensor("lm_head.weight", tied=False)
    assert not last.owns_checkpoint_tensor("model.embed_tokens.weight", tied=False)
    assert last.owns_checkpoint_tensor("model.embed_tokens.weight", tied=True)  # the tied head
    assert last.owns_checkpoint_tensor("model.norm.weight", tied=False)
