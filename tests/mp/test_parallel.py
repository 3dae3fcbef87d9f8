"""Parallel layouts with real processes (2 simulated nodes x 2 ranks, gloo): FSDP2 over all 4 ranks, HSDP
(2 replicas x 2 shards, every block's activations recomputed in backward, the blocks compiled), tensor
parallelism (2 replicas x tp 2, sequence-parallel norms) and TP x FSDP train the tiny GPT within float tolerance
of a single process at the same global batch and sample order; FSDP shards hold ~1/4 of the state, TP ~1/2; a
stop signal under FSDP and under TP (with async saves of the shards) resumes bit-identical at the same layout,
and resharded (FSDP -> TP x DP, FSDP -> PP x DP, TP x DP -> TP x FSDP built on the meta device) within tolerance.
Pipeline parallelism (2 stages, 1F1B; TP x PP with GPipe) likewise, its stop resumed bit-identical and its stages'
checkpoint loaded whole (PP -> DDP). Several runs have one rank slowed (a sleep in every step): rank 0's exposed
communication lands in the dimension whose collectives wait for that rank.

Each launch here pays ~4 s of start-up and DTensor's first steps on the test machine's 2 cores, so every reshard
is a resume that a stop test needed anyway, and each source and target layout of a checkpoint appears once: FSDP
shards into TP pieces and into pipeline stages, TP pieces into a 2-D mesh, pipeline stages into whole replicas."""

import json
import os
import re
import shutil
import signal

import pytest

from runconfig import load_config
from rundir.checkpoints import validate
from rundir.contract import EXIT_STOPPED
from tests.conftest import history, rank_pids, run_cli, summary, wait_for_step
from tests.mp.exported import assert_export_reproduces_eval
from tests.mp.test_checkpoint import assert_close_to, common, rows, run, start

pytestmark = pytest.mark.mp

FSDP = ["parallel.dp_replicate=1", "parallel.dp_shard=-1"]
HSDP = ["parallel.dp_shard=2"]
TP = ["parallel.tp=2"]  # dp_replicate -1: 2 replicas (one per node) of a model split over the 2 ranks of a node
PP = ["parallel.pp=2"]  # 2 stages (one per node), the 2 ranks of a node replicas: 1F1B, 2 pipeline micro-batches
# seconds a slowed rank sleeps in each loop micro-batch: well above the scheduling noise of 4 ranks sharing 2 loaded
# cores (at 0.1 s a loaded CI machine once put 0.085 s of HSDP's wait in dp_replicate and 0.099 s in dp_shard)
SLOW = 0.25
STEPS = 12
# bf16 runs against the fp32 one (sets, 12 steps): measured at most 5.5e-4 apart (DDP and FSDP alike), the fp32
# layouts ~3e-6 (test_fsdp_and_hsdp_train_like_one_process); the bounds sit about 10x outside each
BF16_MOVES, BF16_TOL = 5e-5, 5e-3
FLOAT8_TOL = 2e-2  # float8 (emulated) against fp32: measured at most 1.8e-3


def assert_waits_in(run_dir, dim: str, slow: float = SLOW) -> None:
    """Rank 0 waited for the slowed rank in ``dim``'s collectives: its exposed communication per step (records
    after the first) is at least most of the sleep there, more than in any other dimension, and the dimensions
    add up to the exposed communication of the step-time breakdown."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    for r in records:
        assert abs(sum(r["comm_by_dim"].values()) - r["time_comm_s"]) < 1e-6, r
    median = {
        d: sorted(r["comm_by_dim"].get(d, 0.0) for r in records)[len(records) // 2] for d in records[-1]["comm_by_dim"]
    }
    assert median.get(dim, 0.0) >= 0.6 * slow and max(median, key=median.get) == dim, (dim, median)


@pytest.fixture(scope="module")
def sets(small_dataset):
    """12 steps (checkpoints every 4, evaluations every 8): room for a stop after step 6 and a resume, in half the
    time of the 24 that the checkpoint tests run."""
    return [*common(small_dataset), "model.dropout=0", f"train.steps={STEPS}"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, sets):
    """One process, the same global batch (4 micro-batches accumulated instead of 4 ranks)."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    done = run(run_dir, [*sets, "job.nodes=1", "job.ranks_per_node=1"])
    assert done.returncode == 0, done.stdout + done.stderr
    return run_dir


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, sets):
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    done = run(run_dir, [*sets, *FSDP], inject=f"slow:3:{SLOW}")
    assert done.returncode == 0, done.stdout + done.stderr
    return run_dir


def stop(run_dir, sets, *, rank: int) -> None:
    """A run of ``sets`` (async saves) stopped by a signal to one rank after step 5."""
    proc = start(run_dir, [*sets, "checkpoint.async_save=true"], inject=f"await_stop:{rank}:7")
    wait_for_step(run_dir, 5, proc)
    os.kill(rank_pids(run_dir)[rank], signal.SIGUSR2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, out + err
    assert 6 <= history(run_dir)[-1]["step"] < STEPS


def stop_and_resume_bitwise(tmp_path, sets, reference, *, rank: int, resume_sets=()):
    """A run of ``sets`` (async saves) stopped by a signal to one rank after step 5, resumed at the same layout
    (with ``resume_sets``, which must not change a bit): it must end bit-identical to ``reference``. Returns a copy
    of the stopped run, to resume at another layout. That rank waits after step 7 until the signal is there
    (HPC_INJECT await_stop): 12 steps take 3 s, and a loaded machine once delayed the signal past the last one."""
    run_dir = tmp_path / "run"
    stop(run_dir, sets, rank=rank)
    stopped = tmp_path / "stopped"
    shutil.copytree(run_dir, stopped)
    done = run(run_dir, list(resume_sets), resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(run_dir)["params_sha256"] == summary(reference)["params_sha256"]
    assert rows(run_dir) == rows(reference)
    return stopped


def test_fsdp_and_hsdp_train_like_one_process(tmp_path, monkeypatch, sets, single, fsdp):
    assert_close_to(fsdp, single)  # within 1e-4: the sums run in another order (measured ~3e-6 after 20 steps)
    s = summary(fsdp)
    assert s["allreduce"] == "fsdp" and s["parallel"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1}
    assert s["n_params"] == summary(single)["n_params"]
    # Each rank holds a quarter of the parameters and of the AdamW state (plus the padding of uneven shards).
    mine, whole = s["state_bytes_per_rank"], summary(single)["state_bytes_per_rank"]
    for key in ("params", "grads", "optimizer"):
        assert 0.24 < mine[key] / whole[key] < 0.27, (key, mine, whole)
    manifest = validate(fsdp / "checkpoints" / f"step_{STEPS:08d}")
    assert manifest["params_sha256"] == s["params_sha256"]
    assert_waits_in(fsdp, "dp_shard")  # rank 3 slowed: rank 0 waits in FSDP2's all-gathers
    # the model out of FSDP's shards, and out of a DDP run's (the single process's) checkpoint: their eval losses
    assert_export_reproduces_eval(fsdp, tmp_path / "fsdp-export")
    assert_export_reproduces_eval(single, None)  # into RUN_DIR/export/step_N
    sampled = run_cli(["-m", "trainer.sample", str(tmp_path / "fsdp-export"), "--prompt", "def ", "--tokens", "8",
                       "--samples", "2"])  # fmt: skip
    assert sampled.returncode == 0 and sampled.stdout.count("\n--- ") == 2, sampled.stdout + sampled.stderr
    assert re.match(r"# gpt at step 12, 2 continuation\(s\) of 'def '\n--- 1\ndef ", sampled.stdout), sampled.stdout

    hsdp = tmp_path / "hsdp"
    sets_hsdp = [*sets, *HSDP, "parallel.activation_checkpointing=full", "parallel.compile=true"]
    # Dynamo traces the blocks and AOTAutograd splits forward and backward as usual, then torch's debugging override
    # hands the graphs to its aot_eager backend instead of inductor, whose C++ code generation took 27 s of this launch
    # on 4 ranks sharing 2 cores (inductor's own code, on the blocks, is tests/unit/test_activation_checkpointing.py's)
    monkeypatch.setenv("TORCH_COMPILE_OVERRIDE_BACKENDS", ">=0:aot_eager")
    done = run(hsdp, sets_hsdp, inject=f"slow:2:{SLOW}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert_close_to(hsdp, single)
    assert_waits_in(hsdp, "dp_replicate")  # rank 2 (the other replica) slowed: the all-reduce across replicas
    s = summary(hsdp)
    assert s["allreduce"] == "hsdp" and s["parallel"]["dp_replicate"] == 2 and s["parallel"]["dp_shard"] == 2
    assert 0.49 < s["state_bytes_per_rank"]["params"] / whole["params"] < 0.52
    log = (hsdp / "logs" / "rank_00000.log").read_text()
    assert "activation checkpointing: 2 of 2 blocks (full); torch.compile: 2 blocks" in log


def test_bf16_trains_like_fp32_under_ddp_and_fsdp(tmp_path, sets, single):
    """train.precision bf16 on CPU (autocast to bf16; on CPU FSDP2 keeps fp32 parameters, wrap.py) under DDP (the
    default layout) and FSDP2: each run's losses follow the fp32 run's within bf16's rounding, and differ from them by
    more than the fp32 layouts differ among themselves, so the runs did compute in bf16. On 1 node x 2 ranks: the
    precision is each rank's own, whatever the world's shape. float8 (torchao's Float8Linear, its products emulated
    on CPU) under FSDP2 likewise, within float8's rounding (measured at most 1.8e-3 from fp32); without emulation a
    CPU rank refuses it, naming the key."""
    float8 = [*FSDP, "train.float8_emulate=true"]
    runs = (("ddp", [], "bf16"), ("fsdp", FSDP, "bf16"), ("fsdp_float8", float8, "float8"))
    for name, layout, precision in runs:
        run_dir = tmp_path / name
        done = run(run_dir, [*sets, *layout, f"train.precision={precision}", "job.nodes=1"])
        assert done.returncode == 0, done.stdout + done.stderr
        assert (summary(run_dir)["allreduce"] == "fsdp") == bool(layout), summary(run_dir)["allreduce"]
        got, want = rows(run_dir), rows(single)
        assert [r["step"] for r in got] == [r["step"] for r in want] and got[-1]["step"] == STEPS
        diffs = [abs(a[k] - b[k]) for a, b in zip(got, want, strict=True) for k in ("loss", "eval_loss") if b[k]]
        assert BF16_MOVES < max(diffs) < (BF16_TOL if precision == "bf16" else FLOAT8_TOL), (name, diffs)
    # the 12 matrices of the 2 blocks; the head (the output layer, 257 rows) stays bf16
    assert (
        "train.precision=float8: 12 linear layers in float8 (emulated)"
        in (tmp_path / "fsdp_float8" / "logs" / "rank_00000.log").read_text()
    )
    done = run(tmp_path / "refused", [*sets, "train.precision=float8", "job.nodes=1"])
    # whichever rank reports first names itself: each refuses alike
    assert done.returncode == 2 and re.search(
        r"rank [01]: train\.precision=float8 needs float8 matrix products, on NVIDIA GPUs", done.stdout + done.stderr
    ), done.stdout + done.stderr


def test_fsdp_stop_resumes_bitwise_and_reshards_to_tp_and_pp(tmp_path, sets, single, fsdp):
    # Resumed with the shards offloaded to host memory (parallel.offload: FSDP2's CPUOffloadPolicy). On CPU ranks
    # the moves are copies within host memory, so the run must end bit-identical (the memory saved on a GPU is
    # bench/gpu_check.py's offload check).
    resharded = stop_and_resume_bitwise(tmp_path, [*sets, *FSDP], fsdp, rank=1, resume_sets=["parallel.offload=true"])
    log = (tmp_path / "run" / "logs" / "rank_00000.log").read_text()
    assert "FSDP2's shards in host memory (offload)" in log

    # The DCP checkpoint is keyed by parameter name: the FSDP shards load into tensor-parallel pieces and into
    # pipeline stages (whole replicas: the pipeline test's PP -> DDP).
    to_tp, to_pp = resharded, tmp_path / "to_pp"
    shutil.copytree(resharded, to_pp)
    done = run(to_tp, ["parallel.dp_replicate=-1", "parallel.dp_shard=1", *TP], resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(to_tp)["parallel"]["tp"] == 2 and summary(to_tp)["allreduce"] == "replicate"
    assert [e["event"] for e in history(to_tp)].count("resume") == 1
    assert_close_to(to_tp, single)
    done = run(to_pp, ["parallel.dp_replicate=-1", "parallel.dp_shard=1", *PP], resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(to_pp)["parallel"]["pp"] == 2
    assert_close_to(to_pp, single)


def test_tensor_parallel_trains_like_one_process_resumes_bitwise_and_reshards(tmp_path, sets, single):
    reference = tmp_path / "reference"
    done = run(reference, [*sets, *TP])
    assert done.returncode == 0, done.stdout + done.stderr
    assert_close_to(reference, single)  # measured: within 5e-7
    s, whole = summary(reference), summary(single)["state_bytes_per_rank"]
    assert s["allreduce"] == "replicate"
    assert s["parallel"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 2}
    assert s["n_params"] == summary(single)["n_params"]
    # The start event's accumulation is over the 2 data-parallel ranks, not the 4 ranks of the world.
    cfg = load_config(str(reference / "config.yaml"))
    accum = cfg.train.global_batch_size // (cfg.train.micro_batch_size * 2)
    assert [e["grad_accum"] for e in history(reference) if e["event"] == "start"] == [accum]
    for key in ("params", "grads", "optimizer"):  # each matrix split in two; norms and biases of rows whole
        assert 0.49 < s["state_bytes_per_rank"][key] / whole[key] < 0.53, (key, s["state_bytes_per_rank"], whole)
    assert_export_reproduces_eval(reference, tmp_path / "tp-export")  # the model out of TP x DP's pieces

    resharded = stop_and_resume_bitwise(tmp_path, [*sets, *TP], reference, rank=2)

    # TP x DP -> TP x FSDP (a 2-D mesh: FSDP2 shards the tensor-parallel pieces over the replicas), built on the
    # meta device (parallel.meta_init: each rank allocates and fills only its quarter of every matrix). Those fresh
    # values differ from the eager build's (tests/mp/test_fingerprint.py), so following the single process's curve
    # shows that the checkpoint replaced every one of them. With loss parallelism: the head's logits stay split
    # over the tp group and the cross-entropy runs on the pieces (measured within 3e-7 of gathered logits).
    done = run(resharded, ["parallel.dp_replicate=1", "parallel.dp_shard=-1", "parallel.meta_init=true",
                           "parallel.loss_parallel=true"], resume=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "loss parallelism: head's output split by class" in (resharded / "logs" / "rank_00000.log").read_text()
    assert_close_to(resharded, reference, tolerance=1e-5)
    s = summary(resharded)
    assert s["allreduce"] == "fsdp" and s["parallel"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert load_config(str(resharded / "config.yaml")).parallel.meta_init
    assert 0.24 < s["state_bytes_per_rank"]["params"] / whole["params"] < 0.28
    assert_close_to(resharded, single)


def test_pipeline_trains_like_one_process_resumes_bitwise_and_reshards(tmp_path, sets, single):
    """2 stages x 2 replicas with 1F1B; TP 2 x PP 2 with GPipe and 4 pipeline micro-batches. The
    tied embedding and head live on different stages: their gradients are summed there, and the fingerprint counts
    them once."""
    reference = tmp_path / "reference"
    done = run(reference, [*sets, *PP], inject=f"slow:2:{SLOW}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert_close_to(reference, single)  # measured: within 5e-7
    assert_waits_in(reference, "pp")  # rank 2 (the next stage) slowed: rank 0 waits in the schedule's send/recv
    s, alone = summary(reference), summary(single)
    assert s["parallel"] == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}
    assert s["allreduce"] == "replicate"
    assert s["n_params"] == alone["n_params"]
    # A stage holds one of the two blocks, and the embedding or the head (tied: one copy on each end).
    assert 0.55 < s["state_bytes_per_rank"]["params"] / alone["state_bytes_per_rank"]["params"] < 0.62

    tp_pp = tmp_path / "tp_pp"
    sets_tp_pp = [*sets, *PP, *TP, "parallel.pp_schedule=GPipe", "parallel.pp_microbatches=4",
                  "parallel.loss_parallel=true"]  # the last stage's logits split for the loss  # fmt: skip
    # Rank 1 (rank 0's tensor-parallel peer) slowed: rank 0 waits in DTensor's collectives. Its pipeline wait (the
    # bubble while stage 1 computes) grows with the load on the cores. Medians per step, with a sleep in each of the
    # 4 loop micro-batches: 0.02 s alone, pp 0.15 against tp 0.35; 0.02 s beside another test's launch (a CI run),
    # 0.53 against 0.53; 0.1 s beside the tensor-parallel test, 0.78 against 1.0 (pp ahead in 2 of 12 steps).
    # 0.2 s (0.8 s a step) keeps tp ahead by more than that load adds to the bubble.
    done = run(tp_pp, sets_tp_pp, inject="slow:1:0.2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert_waits_in(tp_pp, "tp", slow=0.2)
    assert summary(tp_pp)["parallel"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}
    assert summary(tp_pp)["allreduce"] == "tp"
    assert "loss parallelism: head's output split by class" in (tp_pp / "logs" / "rank_00000.log").read_text()
    assert_close_to(tp_pp, single)

    resharded = stop_and_resume_bitwise(tmp_path, [*sets, *PP], reference, rank=3)

    # The stages' checkpoint (each rank its stage's tensors, the tied copies under both names) loads whole.
    done = run(resharded, ["parallel.pp=1"], resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(resharded)["allreduce"] in ("flat", "auto")
    assert_close_to(resharded, single)


VIRTUAL = ["model.n_layers=4", "job.nodes=2", "job.ranks_per_node=1", "parallel.pp=2", "parallel.pp_stages_per_rank=2"]


def test_virtual_pipeline_stages_train_like_one_process_and_resume_bitwise(tmp_path, sets):
    """Two stages on each of 2 ranks (4 stages of a 4-block GPT): interleaved 1F1B and zero bubble in a loop (rank
    0 runs stages 0 and 2), ZBV and DualPipeV in a V (rank 0 runs stages 0 and 3: the tied embedding and head on one
    rank, its two stages one module for the checkpoint). Each follows one process's losses; ZBV stopped and resumed
    ends bit-identical, and its checkpoint continues on one stage a rank."""
    single = tmp_path / "single"
    done = run(single, [*sets, "model.n_layers=4", "job.nodes=1", "job.ranks_per_node=1"])
    assert done.returncode == 0, done.stdout + done.stderr
    runs = {}
    for kind, extra in (("Interleaved1F1B", []), ("InterleavedZeroBubble", []), ("ZBVZeroBubble", []),
                        ("DualPipeV", ["parallel.pp_microbatches=4"])):  # fmt: skip
        runs[kind] = tmp_path / kind
        done = run(runs[kind], [*sets, *VIRTUAL, f"parallel.pp_schedule={kind}", *extra])
        assert done.returncode == 0, done.stdout + done.stderr
        assert_close_to(runs[kind], single)  # measured: within 2.2e-7
    zbv = [*sets, *VIRTUAL, "parallel.pp_schedule=ZBVZeroBubble"]
    (tmp_path / "stop").mkdir()
    stopped = stop_and_resume_bitwise(tmp_path / "stop", zbv, runs["ZBVZeroBubble"], rank=1)
    done = run(stopped, ["parallel.pp=1", "parallel.pp_stages_per_rank=1", "parallel.pp_schedule=1F1B"], resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_close_to(stopped, single)


def test_virtual_stages_beside_fsdp_and_tp_train_like_one_process_and_resume_bitwise(tmp_path, sets):
    """Two stages on each rank beside data and tensor parallelism (4 ranks, a stage pair per node): interleaved
    1F1B x FSDP2 2 (each stage module an FSDP2 root of its own), ZBV x HSDP (2 replicas; rank 0's embedding and
    the tied head, in two stages of one rank, each its own copy) and interleaved 1F1B x TP 2 follow one process;
    ZBV x HSDP stopped and resumed ends bit-identical, and a DDP run's checkpoint continues as ZBV x HSDP."""
    single = tmp_path / "single"
    done = run(single, [*sets, "model.n_layers=4", "job.nodes=1", "job.ranks_per_node=1"])
    assert done.returncode == 0, done.stdout + done.stderr
    virtual = ["model.n_layers=4", "parallel.pp=2", "parallel.pp_stages_per_rank=2"]
    layouts = {
        "fsdp": ["parallel.pp_schedule=Interleaved1F1B", "parallel.dp_replicate=1", "parallel.dp_shard=2"],
        "tp": ["parallel.pp_schedule=Interleaved1F1B", "parallel.tp=2"],
    }
    for name, extra in layouts.items():
        done = run(tmp_path / name, [*sets, *virtual, *extra])
        assert done.returncode == 0, done.stdout + done.stderr
        assert_close_to(tmp_path / name, single)
    assert summary(tmp_path / "fsdp")["allreduce"] == "fsdp" and summary(tmp_path / "tp")["allreduce"] == "tp"
    zbv = [*sets, *virtual, "parallel.pp_schedule=ZBVZeroBubble", "parallel.dp_shard=1"]
    reference = tmp_path / "zbv"
    done = run(reference, zbv)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(reference)["allreduce"] == "replicate"
    assert_close_to(reference, single)
    (tmp_path / "stop").mkdir()
    stop_and_resume_bitwise(tmp_path / "stop", zbv, reference, rank=0)
    ddp = tmp_path / "ddp"  # a DDP checkpoint (the tied weight's moments under one name) into ZBV x HSDP
    stop(ddp, [*sets, "model.n_layers=4"], rank=3)
    done = run(ddp, zbv[len(sets) :], resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(ddp)["allreduce"] == "replicate"
    assert_close_to(ddp, single)


CP = ["parallel.cp=2"]  # each sequence over the 2 ranks of a node; 2 replicas (one per node): FSDP2 over cp


def test_context_parallel_trains_like_one_process_resumes_bitwise_and_reshards(tmp_path, monkeypatch, sets, single):
    """cp 2 x 2 replicas: torch's ring attention (over the CPU kernel) with head-and-tail chunks; the loss follows
    one process's (attention within a rank's chunks only, or positions counted from 0 on every rank, would not), a
    stop resumes bit-identical, the stopped run continues as cp 2 x tp 2 (with loss parallelism) and as DDP, and a
    DDP run's as cp. cp 2 x FSDP2 2 with full activation checkpointing, compiled, follows one process too."""
    reference = tmp_path / "reference"
    done = run(reference, [*sets, *CP])
    assert done.returncode == 0, done.stdout + done.stderr
    assert_close_to(reference, single)
    s = summary(reference)
    assert s["allreduce"] == "hsdp" and s["parallel"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 2, "tp": 1}
    stopped = stop_and_resume_bitwise(tmp_path, [*sets, *CP], reference, rank=1)
    back = tmp_path / "back"
    shutil.copytree(stopped, back)
    # cp 2 x tp 2 (the sequence over the nodes, the heads inside a node): FSDP2 over cp of TP's pieces
    done = run(stopped, ["parallel.tp=2", "parallel.dp_replicate=1", "parallel.loss_parallel=true"], resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(stopped)["parallel"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2}
    assert_close_to(stopped, reference)
    done = run(back, ["parallel.cp=1"], resume=True)  # and back to DDP
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(back)["allreduce"] != "hsdp" and summary(back)["parallel"]["dp_replicate"] == 4
    assert_close_to(back, reference)
    ddp = tmp_path / "ddp"  # and from DDP
    stop(ddp, sets, rank=3)
    done = run(ddp, CP, resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(ddp)["parallel"]["cp"] == 2
    assert_close_to(ddp, reference)
    monkeypatch.setenv("TORCH_COMPILE_OVERRIDE_BACKENDS", ">=0:aot_eager")  # as the HSDP test: inductor's C++ is slow
    fsdp_cp = tmp_path / "fsdp_cp"
    done = run(fsdp_cp, [*sets, *CP, "parallel.dp_shard=2", "parallel.dp_replicate=1",
                         "parallel.activation_checkpointing=full", "parallel.compile=true"])  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(fsdp_cp)["allreduce"] == "fsdp" and summary(fsdp_cp)["parallel"]["dp_shard"] == 2
    assert_close_to(fsdp_cp, single)  # eval included: whole sequences through the compiled blocks, outside the ring
