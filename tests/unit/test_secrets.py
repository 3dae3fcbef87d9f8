"""Credentials never reach a config: a key named like one, or a value shaped like one, is refused at load with a
message saying where credentials go; the storage section takes the endpoint, never a key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runconfig import ConfigError, load_config
from runconfig.load import to_dict
from runconfig.secrets import find_secret, key_is_secret
from tracking import flat_params

ROOT = Path(__file__).resolve().parents[2]

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


#: Shapes that passed the first rule set (a deny-list of names and five value shapes), each with its key.
SHAPES = [
    ("recipe_args.wandb_key", "3f9a1c0e5b7d2f4a6c8e0b1d3f5a7c9e1b3d5f7a", "its name suggests a credential"),
    ("recipe_args.apikey", "abc", "its name says"),
    ("job.env.PGPASSWORD", "hunter2", "its name says"),
    ("recipe_args.token_file", "hunter2", "its name says where a credential is"),
    ("recipe_args.token_file_path", "hunter2", "its name says where a credential is"),
    ("recipe_args.password_env", "correct horse battery", "its name says where a credential is"),
    ("recipe_args.api_key_path", "3f9a1c0e5b7d2f4a6c8e0b1d3f5a7c9e", "its name says where a credential is"),
    ("job.setup", ["login --token-file hunter2"], "an assignment to token-file"),
    ("recipe_args.awsSecretAccessKey", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "its name says"),
    ("recipe_args.header", "Authorization: Bearer abcdefghijklmnop123", "an Authorization header"),
    ("recipe_args.notify", "https://hooks.slack.com/services/T0000/B0000/XXXXXXXXXXXX", "a Slack webhook"),
    ("data.path", "https://acct.blob.core.windows.net/c/x?sv=2022-11-02&sig=abcd%2Bef1234", "an Azure shared"),
    ("data.path", "https://storage.googleapis.com/b/o?X-Goog-Algorithm=x&X-Goog-Signature=abc", "a signed Google"),
    ("recipe_args.llm", "sk-proj-abcdEFGH1234ijklMNOPqrst", "an API secret key"),
    (
        "recipe_args.bearer_jwt",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlF",
        "its name says",
    ),  # fmt: skip
    (
        "recipe_args.claims",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlF",
        "a JSON Web Token",
    ),  # fmt: skip
    ("job.setup", ["export WANDB_API_KEY=0123456789abcdef"], "an assignment to WANDB_API_KEY"),
    ("job.srun_args", ["--token=abcdef"], "an assignment to token"),
    ("recipe_args.slack", "xoxb-1234-5678-abcdefghij", "a Slack token"),
    ("recipe_args.hf", "hf_abcdefghijklmnopqrstuvwxyz", "an access token"),
    ("recipe_args.auth", "dGhpcyBpcyBhIHNlY3JldCBrZXk9", "its name suggests a credential"),
]


@pytest.mark.parametrize(("key", "value", "why"), SHAPES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(SHAPES)])
def test_each_credential_shape_is_refused_in_a_file_and_an_override(tmp_path, key, value, why):
    data: dict = {}
    node = data
    for part in key.split(".")[:-1]:
        node = node.setdefault(part, {})
    node[key.split(".")[-1]] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert why in str(info.value) and str(path) in str(info.value), str(info.value)
    shown = value if isinstance(value, str) else value[0]
    assert shown not in str(info.value)  # the secret is not echoed
    with pytest.raises(ConfigError, match=WHERE):
        load_config("tiny", [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip()}"])


#: Ordinary values that the broader rules must let through: paths, hashes of data, the config's own words.
ORDINARY = [
    "data.path=/scratch/team/corpus/v2/shards", "comm.compress=bf16",
    "job.setup=[module load cuda/12.4, source /opt/env.sh]", "job.env={NCCL_IB_HCA: mlx5_0, WANDB_MODE: offline}",
    "job.srun_args=[--cpu-bind=cores]", "job.launch_prefix=[nsys, profile, --output=/tmp/p]",
    "job.sbatch_extra={reservation: big, comment: run-1f3a9c77e0b24d11}",
]  # fmt: skip
#: A recipe's own arguments (recipe_args), which the built-in GPT does not take: checked as config data.
ORDINARY_ARGS = {
    "cache_key": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "data_sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "corpus": "s3://team-bucket/corpora/en?versionId=3", "ssh_key": "/home/user/.ssh/id_ed25519",
    "sort_key": "length", "key": "input_ids", "note": "the token budget follows Chinchilla", "tokenizer": "gpt2",
    "max_tokens": 4096, "auth": "none", "session": 2, "signature_dim": 64, "key_file": "keys/model.pem",
    "token_file": "~/.config/hf/token", "token_file_path": "/run/secrets/hf", "password_file": "db.pass",
    "hf_token_env": "HF_TOKEN",
    "setup": "login --token-file /home/user/.tok", "secret_key_path": "/run/secrets/s3",
}  # fmt: skip


def test_ordinary_values_pass_the_broader_rules():
    cfg = load_config("tiny", ORDINARY)
    assert cfg.comm.compress == "bf16" and cfg.job.env["WANDB_MODE"] == "offline"
    for key, value in ORDINARY_ARGS.items():
        assert find_secret({"recipe_args": {key: value}}) is None, key
    for example in sorted(ROOT.glob("examples/*/config.yaml")):
        assert find_secret(yaml.safe_load(example.read_text())) is None, example
    for name in ("tiny", "small"):
        assert find_secret(to_dict(load_config(name))) is None, name


def test_the_trackers_params_name_job_env_variables_without_their_values():
    cfg = load_config("tiny", ["job.env={NCCL_IB_HCA: mlx5_0, UCX_TLS: rc}"])
    params = flat_params(to_dict(cfg))
    assert params["job.env"] == '["NCCL_IB_HCA", "UCX_TLS"]'
    assert not any(k.startswith("job.env.") for k in params) and "mlx5_0" not in params.values()
    assert params["train.steps"] == str(cfg.train.steps)
