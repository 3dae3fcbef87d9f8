"""Config loading and every bad-input case: one clear message naming the file and key, exit status 2."""

import os
import stat
import sys
import time
from pathlib import Path

import pytest

from runconfig import ConfigError, load_config
from runconfig.load import example_names
from rundir import RunDir
from rundir.contract import EXIT_USER_ERROR
from tests.conftest import run_cli


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_examples_load_by_name_and_path():
    assert {"tiny", "small"} <= set(example_names())
    by_name = load_config("tiny")
    assert by_name.job.nodes == 2 and by_name.job.ranks_per_node == 2
    assert by_name.job.world_size == 4
    assert by_name.grad_accum(4) == 1
    by_path = load_config(str(Path("runconfig/examples/tiny.yaml").resolve()))
    assert by_path == by_name


def test_overrides_by_dotted_path():
    cfg = load_config("tiny", ["train.steps=40", "comm.allreduce=flat", "train.lr=1e-3", "data.include=[a, b]"])
    assert cfg.train.steps == 40
    assert cfg.comm.allreduce == "flat"
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.data.include == ["a", "b"]
    assert load_config("tiny").data.verify == "checksum"
    assert load_config("tiny", ["data.verify=size"]).data.verify == "size"


def test_yaml_numbers_are_what_the_author_wrote(tmp_path):
    """YAML 1.1 reads 25:00 as the base-60 integer 1500 (a 25-hour limit); the config reads it as Slurm does."""
    for text, minutes in [("25:00", 25), ("1:00:00", 60), ("'01:00:00'", 60), ("90", 90), ("2-00", 2880)]:
        cfg = load_config(write(tmp_path, f"job:\n  time: {text}\n"))
        assert cfg.job.time_minutes == minutes, (text, cfg.job.time)
    assert load_config("tiny", ["job.time=25:00"]).job.time_minutes == 25
    cfg = load_config(write(tmp_path, "train:\n  lr: 1.5e-3\n  steps: 0x10\n"))
    assert cfg.train.lr == 1.5e-3 and cfg.train.steps == 16


BILLION_LAUGHS = """\
recipe: lab.recipes:mlp
recipe_args:
  a: &a [x, x, x, x, x, x, x, x, x, x]
  b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
  c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
  d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
  e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
  f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]
  g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]
  h: [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]
"""


def test_aliases_that_expand_a_short_file_into_a_huge_one_are_refused(tmp_path):
    """Ten lines that expand to 10^8 values: refused at once with one message, before anything copies them
    (dataclasses.asdict of the resolved config hung while memory grew). Aliases of a normal size still load."""
    path = write(tmp_path, BILLION_LAUGHS)
    began = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert time.perf_counter() - began < 2.0
    assert str(err.value).startswith(f"config file {path}: its aliases (*name) expand to more than 100,000 values")
    with pytest.raises(ConfigError, match="refer to themselves"):
        load_config(write(tmp_path, "recipe_args: &r {me: *r}\n"))
    cfg = load_config(write(tmp_path, "train: {steps: &n 7, log_every: *n}\n"))
    assert cfg.train.steps == cfg.train.log_every == 7
    big = "recipe: lab.recipes:mlp\nrecipe_args: {sizes: [" + "1, " * 100_500 + "1]}\n"  # large, but no aliases
    assert len(load_config(write(tmp_path, big)).recipe_args["sizes"]) == 100_501


def test_ints_accepted_for_floats(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  lr: 1\n  min_lr: 0\n"))
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1.0


@pytest.mark.parametrize(
    "text,needles",
    [
        ("trian:\n  steps: 3\n", ["unknown key 'trian'", "job, model, data, train, comm"]),
        ("train:\n  stepz: 3\n", ["unknown key 'train.stepz'", "steps", "global_batch_size"]),
        ("train:\n  steps: many\n", ["'train.steps'", "integer", "'many'"]),
        ("train:\n  steps: 2.5\n", ["'train.steps'", "integer"]),
        ("train:\n  lr: fast\n", ["'train.lr'", "number"]),
        ("train:\n  steps: 0\n", ["'train.steps'", ">= 1"]),
        ("train:\n  lr: -1\n", ["'train.lr'", "> 0"]),
        ("comm:\n  allreduce: ring\n", ["'comm.allreduce'", "'auto', 'flat', 'hierarchical', 'leader', 'two_level'"]),
        ("model:\n  d_model: 100\n  n_heads: 3\n", ["'model.n_heads'", "does not divide"]),
        ("job:\n  name: 'a b$(x)'\n", ["'job.name'"]),
        ("train: 5\n", ["'train' must be a mapping"]),
        ("- a\n- b\n", ["top level must be a mapping"]),
        ("train:\n  steps: [1\n", ["not valid YAML", "line"]),
        ("train:\n  steps: 3\n  lr: 0.1\n  steps: 300\n", ["key 'steps' appears twice", "lines 2 and 4"]),
        ("job:\n  nodes: 1\njob:\n  nodes: 2\n", ["key 'job' appears twice", "lines 1 and 3"]),
        ("job:\n  time: 25:60\n", ["'job.time'", "MM:SS"]),
        ("data:\n  verify: sha1\n", ["'data.verify'", "'checksum' or 'size'", "'sha1'"]),
        (
            "job:\n  ranks_per_node: 4\n  gpus_per_node: 2\n",
            ["'job.ranks_per_node'", "4 ranks per node on 2 GPU(s)", "NCCL allows one rank per GPU"],
        ),
        (
            "job:\n  nodes: 3\n  ranks_per_node: 1\ntrain:\n  global_batch_size: 32\n  micro_batch_size: 4\n",
            ["'train.global_batch_size'", "32 is not a multiple", "3 nodes"],
        ),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, text, needles):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert path in message
    for needle in needles:
        assert needle in message, message
    assert "\n" not in message.strip()


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.stepz=3", "unknown key 'train.stepz' (train has: steps"),
        ("nothing=3", "unknown key 'nothing'"),
        ("train.steps.x=3", "train.steps is a value"),
        ("train.steps", "KEY=VALUE"),
        ("train.steps=abc", "'train.steps' must be an integer"),
    ],
)
def test_bad_override(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    assert needle in str(info.value)


def test_ranks_may_share_gpus_without_nccl():
    for sets in (["comm.backend=gloo"], ["train.device=cpu"]):
        load_config("tiny", ["job.ranks_per_node=4", "job.gpus_per_node=2", "train.micro_batch_size=4", *sets])


def test_missing_config_lists_examples():
    with pytest.raises(ConfigError) as info:
        load_config("no-such-config.yaml")
    assert "no-such-config.yaml" in str(info.value) and "tiny" in str(info.value)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["missing.yaml"], "missing.yaml"),
        (["tiny", "--set", "train.stepz=1"], "train.stepz"),
        (["tiny", "--set", "job.nodes=0"], "job.nodes"),
    ],
)
def test_cli_user_errors_exit_2_without_traceback(args, needle):
    proc = run_cli(["-m", "hpc.submit", "--local", *args])
    assert proc.returncode == EXIT_USER_ERROR
    assert proc.stderr.startswith("error: ")
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    "content,offset",
    [
        ("train:\n  steps: 3  # café\n".encode("latin-1"), 24),  # Latin-1 é
        (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)), 136),  # a binary file: 0x80 is the first non-UTF-8 byte
    ],
    ids=["latin-1", "binary"],
)
def test_non_utf8_config_is_a_config_error(tmp_path, content, offset):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    message = str(info.value)
    assert str(path) in message and "not UTF-8" in message and f"offset {offset}" in message, message
    assert "\n" not in message.strip()
    proc = run_cli(["-m", "hpc.submit", str(path), "--local", "--dry-run"])
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr
    assert proc.stderr.startswith("error: ") and str(path) in proc.stderr and f"offset {offset}" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_dry_run_is_torch_free_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    code = (
        "import sys; from hpc.submit import main; "
        f"rc = main(['tiny', '--local', '--dry-run', '--run-dir', {str(run_dir)!r}]); "
        "assert 'torch' not in sys.modules, 'hpc imported torch'; sys.exit(rc)"
    )
    proc = run_cli(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert "mpirun" in proc.stdout and "-n 4" in proc.stdout
    assert "ranks_per_node: 2" in proc.stdout
    assert not run_dir.exists()


def test_run_dir_is_private(tmp_path):
    rundir = RunDir(tmp_path / "r")
    old = os.umask(0o022)
    try:
        rundir.create()
    finally:
        os.umask(old)
    for path in (rundir.root, rundir.logs, rundir.checkpoints):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_existing_run_dir_is_refused(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "something").write_text("x")
    proc = run_cli(["-m", "hpc.submit", "tiny", "--local", "--run-dir", str(tmp_path / "r")])
    assert proc.returncode == EXIT_USER_ERROR and "already exists" in proc.stderr


def test_hpc_does_not_import_torch():
    proc = run_cli(["-c", "import sys, hpc.submit, hpc.local, hpc.mpi, hpc.follow; print('torch' in sys.modules)"])
    assert proc.stdout.strip() == "False", proc.stderr
    assert sys.executable


def test_sweep_grid_file_errors_name_the_file(tmp_path):
    from hpc.sweep import read_grid

    grid = tmp_path / "grid.yaml"
    grid.write_bytes(b"grid:\n  train.lr: [1e-3, \xe9]\n")
    with pytest.raises(ConfigError, match=rf"sweep file {grid} is not UTF-8 text: the byte at offset 25"):
        read_grid(grid)
    with pytest.raises(ConfigError, match="does not exist"):
        read_grid(tmp_path / "missing.yaml")


def test_recipe_keys(tmp_path):
    """recipe: gpt or module:function; recipe_args a free mapping reachable by --set; model only for gpt."""
    path = tmp_path / "c.yaml"
    path.write_text("recipe: proj.train:recipe\nrecipe_args: {hidden: 64, sizes: [1, 2]}\n")
    cfg = load_config(str(path), ["recipe_args.hidden=128", "recipe_args.extra.depth=2", "job.env.FOO=bar"])
    assert cfg.recipe == "proj.train:recipe"
    assert cfg.recipe_args == {"hidden": 128, "sizes": [1, 2], "extra": {"depth": 2}}
    assert cfg.job.env == {"FOO": "bar"}
    assert load_config("tiny").recipe == "gpt"
    for overrides, needle in [
        (["recipe=proj train"], "key 'recipe': 'proj train' must be 'gpt' or 'package.module:function'"),
        (["recipe=proj.train"], "must be 'gpt' or 'package.module:function'"),
        (["model.d_model=64"], "key 'model': configures the built-in gpt recipe; recipe proj.train:recipe takes"),
        (["recipe=gpt"], "key 'recipe_args': the built-in gpt recipe takes its settings from the model section"),
        (["recipe_args=[1]"], "key 'recipe_args' must be a mapping with string keys"),
        (["data.prefetch=-1"], "key 'data.prefetch': must be >= 0"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(str(path), overrides)
        assert needle in str(info.value), (overrides, str(info.value))


def test_the_configuration_reference_is_generated_from_the_schema_and_current():
    """docs/configuration.md is what `python -m runconfig.reference` makes of the field declarations: every key of
    every section, its default and declared rule (a stale page fails here; run the command to refresh it)."""
    import dataclasses
    import typing

    from runconfig.reference import PAGE, markdown
    from runconfig.schema import RunConfig

    text = markdown()
    assert PAGE.read_text() == text, "docs/configuration.md is stale: run python -m runconfig.reference"
    for name, kind in typing.get_type_hints(RunConfig).items():
        keys = [f"{name}.{f.name}" for f in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else [name]
        for key in keys:
            assert f"| `{key}` |" in text, key
    assert "| `train.steps` | integer | `200` | >= 1 |" in text
    assert "| `job.restart_backoff_s` | number | `5.0` | between 0 and 3600 seconds |" in text
    assert run_cli(["-m", "runconfig.reference", "--check"]).returncode == 0


def test_a_renamed_key_is_still_read_with_a_one_line_warning_naming_the_new_one(tmp_path, capsys):
    config = tmp_path / "old.yaml"
    config.write_text("job:\n  max_restarts: 3\n")
    assert load_config(str(config)).job.max_requeues == 3
    warning = capsys.readouterr().err.strip()
    assert warning.count("\n") == 0 and "'job.max_restarts' is now 'job.max_requeues'" in warning
    assert load_config("tiny", ["job.max_restarts=5"]).job.max_requeues == 5
    assert "'job.max_requeues'" in capsys.readouterr().err
    config.write_text("job:\n  max_restarts: 3\n  max_requeues: 4\n")
    with pytest.raises(ConfigError, match="'job.max_restarts' and 'job.max_requeues' are the same setting"):
        load_config(str(config))


def test_spares_need_a_data_parallel_layout():
    """job.spare_ranks keeps each survivor's whole replica across an in-process restart: a sharded layout is refused
    at the edge, naming the key, as is checkpoint.resume: false (a new generation restores); a DDP one loads."""
    assert load_config("tiny", ["job.spare_ranks=2"]).job.spare_ranks == 2
    with pytest.raises(ConfigError, match=r"job\.spare_ranks.*data-parallel layouts only"):
        load_config("tiny", ["job.spare_ranks=1", "job.nodes=2", "parallel.dp_shard=2"])
    with pytest.raises(ConfigError, match=r"job\.spare_ranks.*checkpoint\.resume: false forbids"):
        load_config("tiny", ["job.spare_ranks=1", "checkpoint.resume=false"])


def test_sync_fragments_stream_diloco_rounds_and_divide_them():
    """comm.sync_fragments: a fragment meets at a whole step of the round, and only rounds have fragments."""
    base = ["job.nodes=2", "comm.sync=diloco", "comm.sync_every=8", "checkpoint.every_steps=8"]
    assert load_config("tiny", [*base, "comm.sync_fragments=4"]).comm.sync_fragments == 4
    with pytest.raises(ConfigError, match=r"comm\.sync_fragments.*3 does not divide comm\.sync_every=8"):
        load_config("tiny", [*base, "comm.sync_fragments=3"])
    with pytest.raises(ConfigError, match=r"comm\.sync_fragments.*comm\.sync is ddp"):
        load_config("tiny", ["comm.sync_fragments=2"])
