"""Config schema and run-directory layout shared by the login-node side and the trainer (torch-free)."""

from runconfig.load import ConfigError, config_hash, dump_yaml, from_dict, load_config
from runconfig.rundir import RunDir
from runconfig.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "RunDir", "config_hash", "dump_yaml", "from_dict", "load_config"]
