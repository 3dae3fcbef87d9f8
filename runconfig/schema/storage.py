"""Object storage (s3://, gs://, any fsspec URL) wherever a path is taken: the endpoint and retries, never the
credentials (those come from the environment, an AWS profile or the instance role)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from runconfig.schema.fields import Problems, Range, Section, doc

ENDPOINT_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(/[^\s@]*)?$")


@dataclass(frozen=True, kw_only=True)
class StorageConfig(Section):
    endpoint_url: str | None = doc(
        "Endpoint of an S3-compatible store for s3:// URLs (an on-premise store: MinIO, Ceph RGW, ...), e.g. "
        "http://s3.cluster.local:9000. Unset: $AWS_ENDPOINT_URL, else AWS itself. Credentials never go here: they "
        "come from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment, an AWS profile or the instance role.",
        None,
    )
    region: str | None = doc("Region of s3:// URLs; unset: $AWS_DEFAULT_REGION or the profile's.", None)
    profile: str | None = doc(
        "A named AWS profile (~/.aws/credentials) to take credentials from; unset: $AWS_PROFILE or the default chain.",
        None,
    )
    retries: int = doc(
        "Further attempts at an object-storage request that failed transiently (connection refused or reset, "
        "timeouts, 5xx, throttling), with exponential back-off; then the launch fails as a crash and is restarted "
        "(job.max_failures). Missing objects, denied access and bad credentials are not retried.",
        5,
        bounds=Range(ge=0),
    )
    retry_backoff_s: float = doc(
        "Seconds before the first retry of an object-storage request; each next one waits twice as long (at most "
        "30 s, with jitter), and no retry starts later than 120 s after the first attempt.",
        0.5,
        bounds=Range(gt=0, le=60, text="in (0, 60] seconds"),
    )

    def relations(self) -> Problems:
        url = self.endpoint_url
        if url is not None and not ENDPOINT_RE.fullmatch(url):
            why = "holds credentials (user:password@): they go in the environment" if "@" in url else ""
            return [("endpoint_url", why or f"must be an http:// or https:// URL of the store, got {url!r}")]
        return []
