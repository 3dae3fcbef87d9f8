"""Worker: ``python prepare_cached_data.py CONFIG [KEY=VALUE ...]`` prepares the dataset that CONFIG's ``data:``
section finds on first use into the folder where the trainer's ranks look for it (``dataset_folder`` under the
``data_cache`` of ``from_mpi``: $HPC_DATA_CACHE or its default), and prints that folder.

A child process because those two import mpi4py, which must not initialise MPI in the test process."""

import sys

from runconfig.load import load_config
from trainer.data.prepare import prepare
from trainer.data.resolve import dataset_folder, prepare_spec
from trainer.env import from_mpi

config, overrides = sys.argv[1], sys.argv[2:]
data = load_config(config, overrides).data
assert not data.path, f"{config} names a prepared dataset (data.path {data.path}): nothing to prepare"
folder = dataset_folder(data, from_mpi().data_cache)
prepare(prepare_spec(data), folder)
print(folder)
