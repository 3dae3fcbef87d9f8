"""Refuse config values that look like credentials: a config is copied into the run directory (config.yaml), its
values reach logs, reports and trackers, so a secret there leaks. Credentials come from the environment.

Three rules: a key named as a credential (whatever its value); a key whose name only suggests one (``key``,
``auth``, ``sig``...) holding a random-looking value; and a value shaped like a known credential, anywhere."""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

#: Words of a key name (split at _ - . spaces and camelCase) that mark it as a credential.
SECRET_WORDS = {
    "secret", "secrets", "password", "passwd", "passphrase", "pwd", "token", "credential", "credentials", "apikey",
    "bearer", "privkey",
}  # fmt: skip
SECRET_PAIRS = {
    ("access", "key"), ("secret", "key"), ("api", "key"), ("private", "key"), ("session", "key"), ("account", "key"),
    ("signing", "key"), ("master", "key"), ("client", "secret"), ("auth", "key"), ("license", "key"),
}  # fmt: skip
#: Fragments that mark a name even inside one word (PGPASSWORD, APIKEY, DBSECRET).
SECRET_FRAGMENTS = ("password", "passwd", "passphrase", "secret", "apikey", "credential")
#: Words that only suggest a credential: such a key is refused when its value looks random.
SUSPECT_WORDS = {"key", "auth", "sig", "signature", "cred", "creds", "pat", "hmac", "cookie", "session", "license"}
#: Words that say a suspect key names something else (a hash of data, a sort or cache key, a file).
BENIGN_WORDS = {
    "sha", "sha1", "sha256", "md5", "hash", "digest", "checksum", "fingerprint", "sort", "cache", "shard", "dict",
    "group", "partition", "file", "path", "dir", "name", "id", "type", "column", "field",
}  # fmt: skip

SECRET_VALUES = (
    (re.compile(r"\b(AKIA|ASIA|AIDA|AROA|AGPA)[A-Z0-9]{16}\b"), "an AWS access key id"),
    (re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^/@\s:]+:[^/@\s]+@"), "a URL with a password in it (user:password@)"),
    (re.compile(r"X-Amz-(Signature|Credential)=", re.I), "a pre-signed URL (it carries a signature)"),
    (re.compile(r"X-Goog-(Signature|Credential)=", re.I), "a signed Google Cloud Storage URL"),
    (re.compile(r"[?&]sig=[A-Za-z0-9%+/=]{8,}"), "an Azure shared access signature (sig=)"),
    (
        re.compile(r"[?&](access_token|token|api_key|apikey|key|password)=[A-Za-z0-9%._~+/=-]{8,}", re.I),
        "a URL carrying a credential in its query",
    ),  # fmt: skip
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"\b(ghp|gho|ghs|ghu|ghr|github_pat|hf|npm|glpat)_[A-Za-z0-9_]{16,}"), "an access token"),
    (re.compile(r"\bglpat-[A-Za-z0-9_-]{16,}"), "an access token"),
    (re.compile(r"\bxox[abposre]-[A-Za-z0-9-]{10,}"), "a Slack token"),
    (re.compile(r"hooks\.slack\.com/(services|workflows|triggers)/[A-Za-z0-9/_-]+"), "a Slack webhook URL"),
    (re.compile(r"\b(sk|rk|pk)[-_](live|test|proj|ant|svcacct)[-_][A-Za-z0-9_-]{12,}"), "an API secret key (sk-...)"),
    (re.compile(r"\bsk-[A-Za-z0-9]{20,}"), "an API secret key (sk-...)"),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{35}"), "a Google API key"),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), "a JSON Web Token"),
    (re.compile(r"\bauthorization\s*[:=]", re.I), "an Authorization header"),
    (re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{12,}"), "an Authorization header's credential"),
)
#: NAME=VALUE, --name=VALUE and --name VALUE inside a value (a setup line, an argument): the name is judged by the
#: key rules.
ASSIGNMENTS = (
    re.compile(r"(?:^|[\s;&|'\"(])([A-Za-z_][A-Za-z0-9_]*)=['\"]?([^\s'\";]+)"),
    re.compile(r"(?:^|\s)--?([A-Za-z][A-Za-z0-9_-]*)(?:=|\s+)['\"]?([^\s'\";-][^\s'\";]*)"),
)
WHERE_CREDENTIALS_GO = (
    "credentials never go in a config (it is copied into the run directory, and its values reach logs, reports and "
    "trackers): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or storage.profile naming a "
    "profile in ~/.aws/credentials) in the environment of the submitting shell, which Slurm passes to the job, or "
    "use the nodes' instance role"
)


def _words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", key)  # awsSecretAccessKey -> aws Secret Access Key
    return [w for w in re.split(r"[_\-.\s]+", spaced.lower()) if w]


#: Last words that make a credential's name say where the credential is (``token_file``, ``password_env``,
#: ``--token-file PATH``): such a key is only suspect (refused when its value looks random, not when it is a path).
POINTER_WORDS = {"file", "path", "dir", "env", "var", "variable"}


def key_is_secret(key: str) -> bool:
    """Whether a key's name says it holds a credential (whatever its value)."""
    words = _words(key)
    if len(words) > 1 and words[-1] in POINTER_WORDS:
        return False
    pairs = set(zip(words, words[1:], strict=False))
    if SECRET_WORDS.intersection(words) or SECRET_PAIRS.intersection(pairs):
        return True
    return any(fragment in word for word in words for fragment in SECRET_FRAGMENTS)


def key_is_suspect(key: str) -> bool:
    """Whether a key's name suggests a credential without saying so (``wandb_key``, ``auth``, ``sig``)."""
    words = _words(key)
    return bool(SUSPECT_WORDS.intersection(words)) and not BENIGN_WORDS.intersection(words)


def points_to_secret(key: str) -> bool:
    """Whether a key names where a credential is (``token_file``, ``password_env``, ``token_file_path``), not the
    credential."""
    words = _words(key)
    while len(words) > 1 and words[-1] in POINTER_WORDS:
        words.pop()
    return len(words) < len(_words(key)) and key_is_secret("_".join(words))


def pointer_misused(key: str, value: str) -> bool:
    """Whether the value of such a key is not what its name says: a variable's name for ``_env``/``_var``, a path
    or file name for the others (a password or a random key in its place is refused)."""
    if _words(key)[-1] in ("env", "var", "variable"):
        return not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value) or looks_random(value)
    pathlike = "/" in value or value.startswith("~") or re.fullmatch(r"[\w.-]+\.[A-Za-z0-9]{1,8}", value)
    return not pathlike or looks_random(value.rsplit("/", 1)[-1])


def looks_random(value: str) -> bool:
    """A value of 16+ characters from a token's alphabet, letters and digits mixed, with a random string's spread
    of characters (a hex or base64 key); not a path, a URL or a word."""
    if len(value) < 16 or not re.fullmatch(r"[A-Za-z0-9+/=_\-.~]+", value):
        return False
    if value.startswith(("/", "~", "./", "../")) or not (re.search(r"[0-9]", value) and re.search(r"[A-Za-z]", value)):
        return False
    counts = Counter(value)
    entropy = -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())
    return entropy >= 3.0


def value_secret(value: str) -> str | None:
    """What kind of secret ``value`` looks like, or None."""
    for pattern, what in SECRET_VALUES:
        if pattern.search(value):
            return what
    for pattern in ASSIGNMENTS:
        for match in pattern.finditer(value):
            name, assigned = match.groups()
            if (
                key_is_secret(name)
                or (points_to_secret(name) and pointer_misused(name, assigned))
                or (key_is_suspect(name) and looks_random(assigned))
            ):
                return f"an assignment to {name}"
    return None


def entry_secret(key: str, value: Any) -> str | None:
    """Why the config entry ``key: value`` looks like a credential, or None."""
    if key_is_secret(key) and value not in (None, "", [], {}):
        return "its name says it holds a credential"
    if points_to_secret(key) and value not in (None, "") and pointer_misused(key, str(value)):
        return "its name says where a credential is, but its value is not a file path or a variable's name"
    if isinstance(value, str) and key_is_suspect(key) and looks_random(value):
        return "its name suggests a credential and its value looks like a random key"
    return None


def find_secret(raw: Any, prefix: str = "") -> tuple[str, str] | None:
    """(dotted key, why) of the first value in config data that looks like a credential, or None."""
    if isinstance(raw, dict):
        for key, value in raw.items():
            dotted = f"{prefix}{key}"
            why = entry_secret(str(key), value)
            if why:
                return dotted, why
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
