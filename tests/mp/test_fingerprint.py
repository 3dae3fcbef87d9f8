"""params_sha256 (format 3) does not depend on the layout: the same weights whole on every rank, sharded by FSDP2
over 4 ranks, by HSDP, by tensor parallelism, by TP x FSDP and cut into pipeline stages give the single-process
value, and each rank hashes only its share of the parameters. Built on the meta device and materialised after the
split (parallel.meta_init), every layout starts from the same weights."""

import pytest

from rundir.contract import SIMULATE_VAR
from tests.conftest import rank_results, run_mpi

pytestmark = pytest.mark.mp


def test_fingerprint_is_the_same_for_every_layout_and_split_over_ranks(tmp_path):
    import torch

    from runconfig import load_config
    from trainer.checkpoint.fingerprint import params_sha256, params_sha256_v1
    from trainer.models.gpt import GPT
    from trainer.parallel.materialise import materialise, owners, params_on_meta

    proc = run_mpi(4, ["tests/mp/workers/fingerprint_layouts.py", str(tmp_path)], env={SIMULATE_VAR: "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = rank_results(tmp_path)
    cfg = load_config("tiny", ["model.d_model=36", "model.n_layers=2", "model.seq_len=16", "model.vocab_size=259"])
    torch.manual_seed(3)
    alone = GPT(cfg.model)
    single, single_v1 = params_sha256(alone), params_sha256_v1(alone.named_parameters())
    names = {n for n, _ in alone.named_parameters()}
    for r in results:
        assert r["whole"] == r["fsdp"] == r["hsdp"] == r["tp"] == r["tp_fsdp"] == single, r["rank"]
        assert r["pp"] == r["pp_tp"] == single, r["rank"]
        assert r["v1_fsdp"] == r["v1_hsdp"] == r["v1_tp"] == r["v1_tp_fsdp"] == single_v1
    for layout in ("whole", "fsdp", "hsdp", "tp", "tp_fsdp", "pp", "pp_tp"):
        shares = [set(r[f"hashed_{layout}"]) for r in results]
        assert set.union(*shares) == names and sum(map(len, shares)) == len(names)  # each parameter once
        assert all(shares), shares  # every rank takes a part
    assert single != single_v1
    # parallel.meta_init: every layout materialises the same initial weights, those of one process doing the same
    with params_on_meta():
        torch.manual_seed(3)
        meta = GPT(cfg.model)
    assert materialise(meta, owners(meta), meta.init_weights, seed=0, device=torch.device("cpu"), spec="gpt") is None
    assert meta.head.weight is meta.tok.weight  # still tied
    by_meta = params_sha256(meta)
    for r in results:
        layouts = ("whole", "fsdp", "hsdp", "tp", "tp_fsdp", "pp", "pp_tp")
        assert {r[f"meta_{name}"] for name in layouts} == {by_meta}, r
    assert by_meta != single  # module by module from the seed, not the eager build's one stream
