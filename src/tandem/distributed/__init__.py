"""Process topology for pipeline x data parallelism, its process groups, and tensor dicts
between pipeline stages."""

from tandem.distributed.partition import MissingLayer, StageLayers, build_layers, partition_layers, stage_layers
from tandem.distributed.tensor_dict import PendingSend, StageLink, StageLinkError
from tandem.distributed.topology import StageGroups, Topology, init_stage_groups

__all__ = [
    "MissingLayer",
    "PendingSend",
    "StageGroups",
    "StageLayers",
    "StageLink",
    "StageLinkError",
    "Topology",
    "build_layers",
    "init_stage_groups",
    "partition_layers",
    "stage_layers",
]
