"""The typed run configuration: one keyword-only dataclass per concern, each in its own module.

Every field is documented where it is declared (``doc=`` metadata), with its simple rule (bounds, choices) beside
it; ``runconfig.load`` checks the types from the annotations, then every field's rule (``fields.field_problems``),
each section's ``relations()`` and the checks that span sections (``RunConfig.check``), so a config object that
exists is a valid one. Torch-free: the login-node side (``hpc``) and the trainer both import it.
"""

from runconfig.schema.checkpoint import CheckpointConfig
from runconfig.schema.comm import CommConfig
from runconfig.schema.cost import CostConfig
from runconfig.schema.data import MIN_SHARD_TOKENS, DataConfig
from runconfig.schema.fields import Problems, Range, Section, doc, field_problems
from runconfig.schema.job import JobConfig
from runconfig.schema.live import LiveConfig
from runconfig.schema.model import ModelConfig
from runconfig.schema.monitor import MonitorConfig
from runconfig.schema.parallel import ParallelConfig
from runconfig.schema.prune import PruneConfig
from runconfig.schema.recipe import BUILTIN_RECIPE, RECIPE_RE
from runconfig.schema.run import RunConfig
from runconfig.schema.slurm_syntax import SIGNAL_NAMES, SLURM_NAMES_RE, slurm_minutes
from runconfig.schema.storage import StorageConfig
from runconfig.schema.tracking import TrackingConfig
from runconfig.schema.train import TrainConfig

__all__ = [
    "BUILTIN_RECIPE",
    "MIN_SHARD_TOKENS",
    "RECIPE_RE",
    "SIGNAL_NAMES",
    "SLURM_NAMES_RE",
    "CheckpointConfig",
    "CommConfig",
    "CostConfig",
    "DataConfig",
    "JobConfig",
    "LiveConfig",
    "ModelConfig",
    "MonitorConfig",
    "ParallelConfig",
    "PruneConfig",
    "Problems",
    "Range",
    "RunConfig",
    "Section",
    "StorageConfig",
    "TrackingConfig",
    "TrainConfig",
    "doc",
    "field_problems",
    "slurm_minutes",
]
