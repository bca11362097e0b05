"""The public commands keep their names after the move into layers, run from any directory, answer --help, and
say bad input in one line on stderr with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.timeout(300)


def run(cwd, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONWARNINGS": "default"})
    assert "found in sys.modules" not in proc.stderr  # a command imported twice under two names
    return proc


DRIVER = os.path.join(os.path.dirname(__file__), "cli_driver.py")
COMMANDS = ["lightning_shard.train", "lightning_shard.estimate", "lightning_shard.consolidate", "lightning_shard.bench",
            "lightning_shard.app.sweep"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help(tmp_path, command):
    proc = run(tmp_path, command, "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout or "powered by Hydra" in proc.stdout
    assert list(tmp_path.iterdir()) == []


TRAIN = "lightning_shard.train"
BAD_INPUT = [  # (command, args, what its one line says); all fail before any rank starts
    (TRAIN, ["strategy=zero9"], "Could not find 'strategy/zero9'"),
    (TRAIN, ["strategy.sharding=zero9"], "`sharding` must be one of 'full', 'grad_op', 'hybrid', 'none'; got 'zero9'"),
    (TRAIN, ["strategy.unit_size=-5"], "`unit_size` must be a positive int"),
    (TRAIN, ["strategy.compile=maybe"], "`compile` must be True, False, or a dict of torch.compile's keyword"),
    (TRAIN, ["strategy.min_unit_size=0"], "`min_unit_size` must be a positive int"),
    (TRAIN, ["precision=fp8"], "`precision` must be one of 32-true, bf16-mixed, 16-mixed, bf16-true; got 'fp8'"),
    (TRAIN, ["strategy=hybrid", "strategy.shard_size=3", "trainer.devices=4"],
     "strategy.shard_size=3 must divide the world size 4 (trainer.devices=4 x trainer.num_nodes=1)"),
    (TRAIN, ["+strategy.shard_size=2"], "`shard_size` is the size of hybrid sharding's groups"),
    ("lightning_shard.estimate", ["strategy.sharding=zero9"], "`sharding` must be one of 'full', 'grad_op', 'hybrid', 'none'"),
    ("lightning_shard.estimate", ["trainer.accumulate_grad_batches=2.5"],
     "`trainer.accumulate_grad_batches` must be an int >= 1; got 2.5"),
    (TRAIN, ["trainer.accumulate_grad_batches=0"], "`trainer.accumulate_grad_batches` must be an int >= 1; got 0"),
    ("lightning_shard.consolidate", ["no_such.ckpt"], "does not exist"),
    ("lightning_shard.consolidate", [], "the following arguments are required: checkpoint_dir (see --help)"),
    # never over a directory, nor into the checkpoint being read (files.commit would replace what is there)
    ("lightning_shard.consolidate", ["run.ckpt", "."], "'.' is a directory; OUT must be a file path"),
    ("lightning_shard.consolidate", [".", "x.ckpt"], "OUT 'x.ckpt' lies inside the checkpoint"),
    ("lightning_shard.bench", ["--world", "0"], "argument --world: must be an integer >= 1; got '0'"),
    ("lightning_shard.bench", ["--device", "cuda", "--world", "99"],  # a bad request on any machine
     "--world 99 on cuda needs 99 GPUs" if torch.cuda.is_available() else "--device cuda: no CUDA device here"),
    ("lightning_shard.bench", ["--world", "2", "--configs", "plain"], "plain (Lightning with no strategy) runs on one"),
    ("lightning_shard.bench", ["--world", "2", "--configs", "plain_compiled"], "plain (Lightning with no strategy)"),
    ("lightning_shard.bench", ["--world", "4", "--configs", "shard_hybrid", "--shard-size", "3"],
     "--shard-size 3 does not divide --world 4"),
    ("lightning_shard.tools.bench_overhead", ["--blocks", "0"], "argument --blocks: must be an integer >= 1"),
    ("lightning_shard.tools.bench_against", ["no_such_revision"], "cannot read revision 'no_such_revision' from git"),
    (TRAIN, ["strategy.offload=cpu"], "`offload` must be None (null in a Hydra config: everything on the device), 'optimizer'"),
    # the Trainer's values and the checkpoint to resume from, before the ranks start (they were a traceback per rank)
    (TRAIN, ["trainer.devices=0"], "`Trainer(devices=0)` value is not a valid input using cpu accelerator"),
    (TRAIN, ["trainer.max_steps=foo"], "`trainer.max_steps` must be an integer; got 'foo'"),
    (TRAIN, ["ckpt_path=no_such.ckpt"], "`ckpt_path`: Checkpoint 'no_such.ckpt' does not exist"),
    (TRAIN, ["ckpt_path=not_a.ckpt"], "`ckpt_path`: 'not_a.ckpt' is not a readable torch checkpoint"),
    ("lightning_shard.tools.bench_offload", ["--offload", "gpu"], "argument --offload: 'gpu': one of none, optimizer,"),
    ("lightning_shard.app.sweep", ["no_such_dir"], "no job of 'no_such_dir' wrote a summary.json"),
]


def test_bad_input_is_one_line_and_exit_status_2(tmp_path):
    """Every case in one interpreter (tests/cli_driver.py): an interpreter start costs more than a case."""
    cases = [(command, [*args, f"hydra.run.dir={tmp_path / 'run'}"] if command == TRAIN else args)
             for command, args, _ in BAD_INPUT]
    (tmp_path / "not_a.ckpt").write_text("a truncated or foreign file")
    proc = subprocess.run([sys.executable, DRIVER, json.dumps(cases)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=280, env={**os.environ, "PYTHONWARNINGS": "ignore", "HYDRA_FULL_ERROR": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (command, args, message), result in zip(BAD_INPUT, json.loads(proc.stdout.splitlines()[-1])):
        case = f"{command} {' '.join(args)}: {result}"
        assert result["code"] == 2, case
        assert result["stderr"].startswith(f"python -m {command}: error: ") and message in result["stderr"], case
        assert len(result["stderr"].splitlines()) == 1, case  # no traceback, no usage, no Hydra hints
        assert "Initializing distributed" not in result["stderr"] + result["stdout"], case


def test_estimate_reads_the_packaged_configs(tmp_path):
    proc = run(tmp_path, "lightning_shard.estimate", "model.model.width=32", "model.model.depth=2",
               "data.seq_len=32", "data.batch_size=4", "trainer.devices=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lightning_shard memory estimate per rank (2 ranks" in proc.stdout
    assert "peak" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written where it was called


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without CUDA")
def test_estimate_for_gpus_on_a_machine_without_cuda_says_what_stood_in(tmp_path):
    proc = run(tmp_path, "lightning_shard.estimate", "trainer=gpu", "trainer.devices=8", "model.model.width=32",
               "model.model.depth=2", "data.seq_len=32", "data.batch_size=4", "precision=bf16-mixed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lightning_shard memory estimate per rank (8 ranks" in proc.stdout
    assert "activations measured with the CPU's kernels" in proc.stdout


def test_the_gpu_sessions_tools_run_on_the_cpu(tmp_path):
    """What `.ci/gpu` and a GPU session run, end to end on a tiny model here: a tool broken on the CPU would waste a
    GPU lease."""
    proc = run(tmp_path, "lightning_shard.tools.profile_host", "--config", "shard_full", "--warmup", "1",
               "--profiled", "1", "--depth", "2", "--width", "64", "--heads", "2", "--seq", "16", "--vocab", "100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 steps profiled: wall" in proc.stdout and "kernel launches per step" in proc.stdout, proc.stdout[-2000:]
    proc = run(tmp_path, "lightning_shard.tools.bench_offload", "--model", "llama-tiny", "--offload", "params",
               "--steps", "1", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"phases_s": {"optimizer": ' in proc.stdout  # each configuration's figures printed as it finishes
    row = next(line for line in proc.stdout.splitlines() if line.startswith("params ") and " done in " not in line)
    assert "error" not in row and len(row.split()) == 16, row  # 13 figures, then the two losses


def test_the_engine_compares_with_a_git_revision(tmp_path):
    """bench_against runs the working tree's engine and a revision's in turns: here HEAD's, two blocks, two steps."""
    proc = run(tmp_path, "lightning_shard.tools.bench_against", "HEAD", "--blocks", "2", "--steps", "2", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("  ")[0].strip(): line.split() for line in proc.stdout.splitlines()[1:4]}
    assert set(rows) == {"REV", "REV again", "working tree"}, proc.stdout
    assert len({row[-1] for row in rows.values()}) == 1, proc.stdout  # the same model and steps: the same last loss
