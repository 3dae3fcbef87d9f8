"""The run configuration: the typed schema, YAML loading and its errors, the parallel layout (torch-free)."""

from runconfig.load import ConfigError, config_hash, dump_yaml, from_dict, load_config
from runconfig.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "config_hash", "dump_yaml", "from_dict", "load_config"]
