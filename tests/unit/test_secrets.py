"""Credentials never reach a config: a key named like one, or a value shaped like one, is refused at load with a
message saying where credentials go; the storage section takes the endpoint, never a key."""

from __future__ import annotations

import pytest

from runconfig import ConfigError, load_config
from runconfig.secrets import find_secret, key_is_secret

WHERE = "credentials never go in a config"


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("job.env.AWS_SECRET_ACCESS_KEY=abc", "its name says it holds a credential"),
        ("job.env.HF_TOKEN=abc", "its name says it holds a credential"),
        ("recipe_args.api_key=abc", "its name says it holds a credential"),
        ("data.path=s3://AKIAIOSFODNN7EXAMPLE@bucket/x", "an AWS access key id"),
        ("storage.endpoint_url=http://user:hunter2@s3.local:9000", "a URL with a password in it"),
        ("data.path=https://b.s3.amazonaws.com/x?X-Amz-Credential=a&X-Amz-Signature=b", "a pre-signed URL"),
    ],
)
def test_a_credential_in_an_override_is_refused(override, why):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    message = str(info.value)
    assert f"key {override.split('=')[0]!r} is refused" in message and why in message and WHERE in message
    assert "AWS_ACCESS_KEY_ID" in message and override.split("=", 1)[1] not in message  # the secret is not echoed


def test_a_credential_in_a_config_file_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  path: s3://bucket/data\nstorage:\n  aws_secret_access_key: wJalrXUtnFEMI\n")
    with pytest.raises(ConfigError, match=f"config {path}: key 'storage.aws_secret_access_key' is refused: its name"):
        load_config(str(path))


def test_ordinary_keys_and_values_pass():
    cfg = load_config("tiny", ["data.path=s3://bucket/prefix", "storage.endpoint_url=http://s3.local:9000"])
    assert cfg.data.path == "s3://bucket/prefix" and cfg.storage.endpoint_url == "http://s3.local:9000"
    assert not any(key_is_secret(k) for k in ("tokenizer", "tokens_seen", "keep_last", "monkey", "max_tokens"))
    assert find_secret({"data": {"tokenizer": "tok.json", "include": ["*.py"]}, "recipe_args": {"keys": 3}}) is None
    with pytest.raises(ConfigError, match="storage.endpoint_url.*must be an http:// or https:// URL"):
        load_config("tiny", ["storage.endpoint_url=s3.local:9000"])
