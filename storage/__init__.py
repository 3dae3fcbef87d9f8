"""Files and objects: atomic writes and JSON lines, file digests, retries of transient I/O errors, object storage
through fsspec, and the shared-memory segments killed MPI ranks leave (torch-free)."""
