"""The sample order, prefetching, and the prepared HDF5 token data that token-based recipes read."""

from __future__ import annotations

from dataclasses import dataclass

from runconfig.schema.fields import Problems, Range, Section, doc

#: Smallest shard of a prepared dataset (data.shard_tokens, and `python -m trainer.data prepare`).
MIN_SHARD_TOKENS = 1024


@dataclass(frozen=True, kw_only=True)
class DataConfig(Section):
    source: str = doc(
        "Folder (or one file) of the corpus to prepare on first use, or 'stdlib' for this Python's standard library "
        "(data.format says how its files are read).",
        "stdlib",
        nonempty="must not be empty",
    )
    format: str = doc(
        "How data.source's files are read: 'text' (a file per document), 'jsonl' (a JSON object per line; .gz and "
        ".zst too), 'parquet' or 'arrow' (a row per document; `datasets`' save_to_disk folders are Arrow), 'tokens' "
        "(ids already encoded: .npy, or .bin in data.token_dtype); 'auto': by each file's ending, text otherwise.",
        "auto",
        choices=("auto", "text", "jsonl", "parquet", "arrow", "tokens"),
    )
    field: str = doc(
        "The JSON field (jsonl) or column (parquet, arrow) that holds each document's text.",
        "text",
        nonempty="must name a field or column",
    )
    token_dtype: str | None = doc(
        "The dtype of raw .bin token files (uint16, uint32, int32, ...); .npy files carry their own.",
        None,
        choices=("uint8", "uint16", "int16", "uint32", "int32", "int64", "uint64"),
    )
    vocab_size: int | None = doc(
        "Token files prepared without data.tokenizer: the vocabulary size their ids come from.",
        None,
        bounds=Range(ge=2),
    )
    eos: int | None = doc(
        "Token files prepared without data.tokenizer: the end-of-document id (between documents in the files, or "
        "added after each document of a NAME.lengths.npy beside a file).",
        None,
        bounds=Range(ge=0),
    )
    include: list[str] = doc(
        "Glob patterns (relative to source) of the files to take.",
        factory=lambda: ["*.py"],
        nonempty="needs at least one pattern",
    )
    max_source_bytes: int = doc("Stop reading the source after this many bytes; 0 = no limit.", 0, bounds=Range(ge=0))
    path: str | None = doc(
        "Prepared dataset folder (manifest.json + HDF5 shards): a path, or a URL of object storage (s3://bucket/"
        "prefix; storage: for the endpoint), whose shards are streamed through the node cache (data.cache_dir). "
        "Unset: a cache folder derived from the source under $HPC_DATA_CACHE (default ~/.cache/hpc-trainer/data).",
        None,
    )
    cache_dir: str | None = doc(
        "Node-local folder where the shards of a data.path URL are kept (one copy per node, whatever the number of "
        "ranks on it; a subfolder per node and dataset). Use local disk ($TMPDIR, /local/scratch). Unset: "
        "$HPC_DATA_CACHE/stream.",
        None,
    )
    cache_max_gb: float = doc(
        "Size bound of the node cache: least recently used shards are evicted to stay under it (about two shuffle "
        "windows of shards must fit). 0 = the disk's own size: a shard that meets a full disk evicts what it can.",
        0.0,
        bounds=Range(ge=0),
    )
    stream_threads: int = doc(
        "Background threads per rank fetching the shards of the current and the next shuffle window into the node "
        "cache.",
        4,
        bounds=Range(ge=1),
    )
    val_fraction: float = doc("Fraction of source files held out for the eval loss.", 0.05, bounds=Range(gt=0, lt=1))
    prepare_workers: int = doc(
        "Processes that prepare data.source on first use (rank 0's node; the output is the same for any number); "
        "0 = every CPU the rank may use.",
        0,
        bounds=Range(ge=0),
    )
    shard_tokens: int = doc("Tokens per HDF5 shard when preparing.", 4_000_000, bounds=Range(ge=MIN_SHARD_TOKENS))
    seed: int = doc("Seed of the global sample order (with the epoch).", 1234)
    order: str = doc(
        "The global sample order. 'windowed': every epoch shuffles the shards, then the samples within each window "
        "of data.shuffle_window consecutive shuffled shards (memory per rank: two integers per shard; a stretch of "
        "training reads a window of the dataset at a time). 'permutation': a full permutation of every sample per "
        "epoch (8 bytes per sample on every rank). 'auto': a resumed run keeps the order its checkpoint records (a "
        "checkpoint that records none: 'permutation'), a new run takes 'windowed'. Neither depends on the world size.",
        "auto",
        choices=("auto", "windowed", "permutation"),
    )
    shuffle_window: int = doc(
        "Shards per shuffle window of the windowed order; a map-style dataset without shards is one block, shuffled "
        "whole. Larger: better mixed batches, more of the dataset needed at once by a streaming node.",
        64,
        bounds=Range(ge=1),
    )
    verify: str = doc(
        "Start-up check of the prepared shards against manifest.json: 'checksum' = each shard's SHA-256 (every "
        "byte read once, the shards split over the ranks); 'size' = only each shard's token count and dtype, for "
        "datasets too large to read at every start, and then every window read while training is range-checked. "
        "Both refuse a vocabulary larger than model.vocab_size.",
        "checksum",
        choices=("checksum", "size"),
    )

    tokenizer: str | None = doc(
        "A tokenizers-package tokenizer.json used when preparing data.source on first use (its ids are stored in the "
        "same HDF5 shards; the vocabulary size comes from it). Unset: bytes (vocabulary 257).",
        None,
    )
    bucket_by_length: bool = doc(
        "For a recipe's dataset of variable-length items (with a `lengths` attribute): group items of similar length "
        "into micro-batches, so that each pads only to its own longest item. The order stays a pure function of "
        "(data.seed, position), independent of the world size; metrics.jsonl reports pad_fraction.",
        False,
    )
    bucket_window: int = doc(
        "Global batches per window within which data.bucket_by_length sorts items by length (larger: less padding, "
        "batches less mixed in length order).",
        16,
        bounds=Range(ge=1),
    )
    prefetch: int = doc(
        "Micro-batches fetched and collated ahead of the step by as many background threads (hides a dataset slower "
        "than a step when its items can be fetched in parallel, e.g. file reads); 0 = fetch in the training thread.",
        2,
        bounds=Range(ge=0),
    )
    read_retries: int = doc(
        "Further attempts at reading a token window that failed with a transient storage error (EIO, ESTALE, "
        "ETIMEDOUT, ...: a network file system's fail-over), the shard reopened each time; then the launch fails "
        "as a crash and is restarted (job.max_failures). Other errors are not retried; 0 = no retries.",
        5,
        bounds=Range(ge=0),
    )
    read_retry_backoff_s: float = doc(
        "Seconds before the first retry of a data read; each next one waits twice as long (at most 30 s, with "
        "jitter), and no retry starts later than 120 s after the first attempt.",
        0.5,
        bounds=Range(gt=0, le=60, text="in (0, 60] seconds"),
    )

    def relations(self) -> Problems:
        if self.tokenizer is not None and (self.vocab_size is not None or self.eos is not None):
            key = "vocab_size" if self.vocab_size is not None else "eos"
            return [(key, "comes from data.tokenizer when one is set; set one or the other")]
        if self.vocab_size is not None and self.eos is not None and self.eos >= self.vocab_size:
            return [("eos", f"must be below data.vocab_size {self.vocab_size}, got {self.eos}")]
        return []
