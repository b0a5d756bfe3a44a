"""One configuration tree shared by the CLI and the library.

Every setting a user can change is a dataclass field here, declared once with `option(...)`:
its default, its help text and (where it differs from the field name) its flag live in the
field's metadata, and `tandem.cli` generates the command-line options from them. A command
declares which sections it takes; nothing else repeats a flag or its default.

The tree has one module per section (the sections `tandem.cli_options` names): `overlap`
(`OverlapConfig`), `parallel` (`ParallelConfig`), `cache` (`CacheConfig`), `scheduler`
(`SchedulerConfig`), `http` (`HttpOptions`) and `engine` (`EngineConfig`, the root that holds
the first four); `options` is how a field becomes a flag (`option`, `cli_fields`). Import
them from here: `from tandem.config import EngineConfig`.
"""

from tandem.config.cache import CacheConfig
from tandem.config.engine import COMPILE_MODES, EngineConfig
from tandem.config.http import HttpOptions
from tandem.config.options import cli_fields, option, parse_int_tuple
from tandem.config.overlap import EXECUTORS, GRAPH_MODES, OVERLAP_POLICIES, UBATCH_SPLITS, OverlapConfig
from tandem.config.parallel import ParallelConfig
from tandem.config.scheduler import SchedulerConfig

__all__ = [
    "COMPILE_MODES",
    "EXECUTORS",
    "GRAPH_MODES",
    "OVERLAP_POLICIES",
    "UBATCH_SPLITS",
    "CacheConfig",
    "EngineConfig",
    "HttpOptions",
    "OverlapConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "cli_fields",
    "option",
    "parse_int_tuple",
]
