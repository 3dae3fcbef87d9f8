"""Sweep files (hpc/sweep.py): grids, random search from a seed, their errors; ASHA's rule over a real rung file
(rundir/rungs.py), several writers at once."""

import json
import math
import multiprocessing

import pytest
import yaml

from hpc.sweep import expand, read_spec
from runconfig import ConfigError
from runconfig.schema import PruneConfig
from rundir.rungs import judge, report


def spec_file(tmp_path, data) -> object:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_random_search_is_drawn_from_its_seed(tmp_path):
    data = {
        "random": {"n": 6, "seed": 3, "train.lr": {"log": [1.0e-4, 1.0e-2]}, "model.dropout": {"uniform": [0, 0.2]},
                   "train.warmup_steps": {"int": [1, 4]}, "model.d_model": [32, 64]},
        "metric": "eval_loss",
    }  # fmt: skip
    spec = read_spec(spec_file(tmp_path, data))
    assert spec.kind == "random" and len(spec.points) == 6 and spec.seed == 3
    assert read_spec(spec_file(tmp_path, data)).points == spec.points  # the same file, the same points
    for p in spec.points:
        assert 1.0e-4 <= p["train.lr"] <= 1.0e-2 and 0 <= p["model.dropout"] <= 0.2
        assert p["train.warmup_steps"] in (1, 2, 3, 4) and p["model.d_model"] in (32, 64)
        assert float(f"{p['train.lr']:.4g}") == p["train.lr"]  # 4 significant digits
    logs = sorted(math.log10(p["train.lr"]) for p in spec.points)
    assert logs[-1] - logs[0] > 0.5  # spread over the decades, not bunched at the top as a uniform draw would be
    data["random"]["seed"] = 4
    assert read_spec(spec_file(tmp_path, data)).points != spec.points


def test_prune_goes_into_every_elements_config(tmp_path):
    data = {"grid": {"train.lr": [1e-3, 2e-3]}, "prune": {"at_steps": [4, 8], "eta": 2}}
    spec, elements = expand("tiny", spec_file(tmp_path, data), ["train.steps=12"], tmp_path / "sw")
    assert spec.prune == {"at_steps": [4, 8], "eta": 2} and len(elements) == 2
    for _, cfg in elements:
        assert cfg.prune == PruneConfig(metric="eval_loss", mode="min", at_steps=[4, 8], eta=2.0,
                                        rungs=str(tmp_path / "sw" / "rungs.jsonl"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"prune\.at_steps.*not before train\.steps=6"):
        expand("tiny", spec_file(tmp_path, data), ["train.steps=6"], tmp_path / "sw")


def test_each_element_checkpoints_under_a_prefix_of_its_own(tmp_path):
    """A checkpoint prefix belongs to one run: the sweep's storage is each element's parent prefix."""
    data = {"grid": {"train.lr": [1e-3, 2e-3]}}
    _, elements = expand("tiny", spec_file(tmp_path, data), ["checkpoint.storage=s3://b/sweep/"], tmp_path / "sw")
    prefixes = [cfg.checkpoint.storage for _, cfg in elements]
    assert prefixes == ["s3://b/sweep/000-lr=0.001", "s3://b/sweep/001-lr=0.002"], prefixes
    _, plain = expand("tiny", spec_file(tmp_path, data), [], tmp_path / "sw")
    assert all(cfg.checkpoint.storage is None for _, cfg in plain)


@pytest.mark.parametrize(
    "data,message",
    [
        ({"random": {"n": 2, "train.lr": {"log": [1e-2, 1e-4]}}}, r"\[0\.01, 0\.0001\] is inverted"),
        ({"random": {"n": 2, "train.lr": {"uniform": [0.1, 0.1]}}}, r"\[0\.1, 0\.1\] is empty"),
        ({"random": {"n": 2, "train.lr": {"log": [0, 1e-2]}}}, "log needs bounds above 0"),
        ({"random": {"n": 2, "train.lr": {"int": [5, 1]}}}, "is inverted"),
        ({"random": {"n": 2, "train.lr": []}}, "an empty list of choices"),
        ({"random": {"n": 2, "train.lr": {"normal": [0, 1]}}}, "write a list of choices or one of"),
        ({"random": {"n": 0, "train.lr": [1]}}, r"random\.n must be a whole number >= 1"),
        ({"random": {"n": 2}}, "at least one config key"),
        ({"random": {"n": 2, "job.nodes": [1, 2]}}, "job shape is shared"),
        ({"grid": {"train.lr": [1]}, "random": {"n": 1}}, "must hold one of grid"),
        ({"grid": {"train.lr": [1]}, "metric": "nope"}, "the results table ranks by one of"),
        ({"grid": {"train.lr": [1]}, "mode": "lowest"}, "mode must be min or max"),
        ({"grid": {"train.lr": [1]}, "prune": {"steps": [4]}}, "prune takes at_steps"),
    ],
)
def test_a_bad_sweep_file_is_named_with_what_is_wrong(tmp_path, data, message):
    path = spec_file(tmp_path, data)
    with pytest.raises(ConfigError, match=message) as caught:
        read_spec(path)
    assert str(path) in str(caught.value)


def test_asha_keeps_the_best_share_of_each_rung():
    assert judge([2.0], 2.0, eta=3, mode="min") == (False, 0, 1)  # alone at the rung: continues
    assert judge([2.0, 3.0], 3.0, eta=3, mode="min") == (False, 1, 2)  # fewer than eta reports: nobody judged
    assert judge([2.0, 3.0, 2.5], 3.0, eta=3, mode="min") == (True, 2, 1)
    assert judge([2.0, 3.0, 2.5], 2.0, eta=3, mode="min") == (False, 0, 1)
    assert judge([0.9, 0.5, 0.7, 0.8], 0.8, eta=2, mode="max") == (False, 1, 2)
    assert judge([0.9, 0.5, 0.7, 0.8], 0.7, eta=2, mode="max") == (True, 2, 2)


def _report(args):
    path, run, value = args
    return report(path, run, 10, value, PruneConfig(metric="eval_loss", at_steps=[10], eta=2)).prune


def test_rung_reports_from_many_processes_are_each_counted_once(tmp_path):
    path = tmp_path / "rungs.jsonl"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_report, [(path, f"run{i}", float(i)) for i in range(8)])
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert sorted(x["run"] for x in lines) == [f"run{i}" for i in range(8)]
    # a relaunched element that reports again keeps its first value; the last verdicts see all eight
    cfg = PruneConfig(metric="eval_loss", at_steps=[10], eta=2)
    again = report(path, "run7", 10, -1.0, cfg)
    assert (again.value, again.reports, again.keep, again.prune) == (7.0, 8, 4, True)
    assert not report(path, "run9", 10, 0.5, cfg).prune  # among the best 4 of 9


def test_a_diverged_element_is_pruned_and_never_a_peers_cutoff(tmp_path):
    path, cfg = tmp_path / "rungs.jsonl", PruneConfig(metric="eval_loss", at_steps=[10], eta=2)
    assert not report(path, "a", 10, 3.0, cfg).prune
    assert report(path, "b", 10, float("nan"), cfg).prune
    assert json.loads(path.read_text().splitlines()[1])["value"] is None
    assert not report(path, "c", 10, 2.5, cfg).prune  # judged against a's report alone: 2 reports, the best goes on
