"""Refuse config values that look like credentials: a config is copied into the run directory (config.yaml), its
values reach logs, reports and trackers, so a secret there leaks. Credentials come from the environment."""

from __future__ import annotations

import re
from typing import Any

#: Words of a key name (split at _ - .) that mark it as a credential.
SECRET_WORDS = {"secret", "password", "passwd", "passphrase", "token", "credential", "credentials"}
SECRET_PAIRS = {("access", "key"), ("secret", "key"), ("api", "key"), ("private", "key"), ("session", "key")}
SECRET_VALUES = (
    (re.compile(r"\b(AKIA|ASIA|AIDA|AROA|AGPA)[A-Z0-9]{16}\b"), "an AWS access key id"),
    (re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://[^/@\s:]+:[^/@\s]+@"), "a URL with a password in it (user:password@)"),
    (re.compile(r"X-Amz-(Signature|Credential)=", re.I), "a pre-signed URL (it carries a signature)"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"\b(ghp|gho|ghs|github_pat|xox[abp]|hf)_[A-Za-z0-9_]{16,}\b"), "an access token"),
)
WHERE_CREDENTIALS_GO = (
    "credentials never go in a config (it is copied into the run directory, and its values reach logs, reports and "
    "trackers): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or storage.profile naming a "
    "profile in ~/.aws/credentials) in the environment of the submitting shell, which Slurm passes to the job, or "
    "use the nodes' instance role"
)


def key_is_secret(key: str) -> bool:
    words = [w for w in re.split(r"[_\-.\s]+", key.lower()) if w]
    pairs = set(zip(words, words[1:], strict=False))
    return bool(SECRET_WORDS.intersection(words) or SECRET_PAIRS.intersection(pairs))


def value_secret(value: str) -> str | None:
    """What kind of secret ``value`` looks like, or None."""
    for pattern, what in SECRET_VALUES:
        if pattern.search(value):
            return what
    return None


def find_secret(raw: Any, prefix: str = "") -> tuple[str, str] | None:
    """(dotted key, why) of the first value in config data that looks like a credential, or None."""
    if isinstance(raw, dict):
        for key, value in raw.items():
            dotted = f"{prefix}{key}"
            if key_is_secret(str(key)) and value not in (None, "", [], {}):
                return dotted, "its name says it holds a credential"
            found = find_secret(value, dotted + ".")
            if found:
                return found
    elif isinstance(raw, list):
        for i, value in enumerate(raw):
            found = find_secret(value, f"{prefix.rstrip('.')}[{i}].")
            if found:
                return found
    elif isinstance(raw, str):
        what = value_secret(raw)
        if what:
            return prefix.rstrip("."), f"its value looks like {what}"
    return None
