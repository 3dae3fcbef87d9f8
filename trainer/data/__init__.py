"""Token data: preparing sharded HDF5 files from text, and reading them in a resumable global order."""
