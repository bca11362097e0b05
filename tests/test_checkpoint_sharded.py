"""Sharded checkpoints: exact round trips across world sizes and unit policies, consolidation, and clear
errors for checkpoints that are incomplete, damaged or of another model."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from tests import checkpoint_scenarios as scenarios
from tests.models import Odd, TinyGPT
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)

BLOCKS = {"units": ["Block"]}
PACKED = {"unit_size": 700}
PER_LAYER = {"units": ["Linear"]}

CASES = [  # (model, saved on, policy, loaded on, policy)
    ("gpt", 2, BLOCKS, 1, PACKED),
    ("gpt", 2, BLOCKS, 3, PACKED),
    ("gpt", 1, PACKED, 2, BLOCKS),
    ("odd", 3, PER_LAYER, 2, {}),
]


def _assert_same_state(saved, loaded, what):
    assert saved.keys() == loaded.keys(), what
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), f"{what}: {name} differs"


@pytest.mark.parametrize(("name", "n", "policy", "m", "new_policy"), CASES,
                         ids=[f"{c[0]}-{c[1]}to{c[3]}" for c in CASES])
def test_save_on_n_ranks_load_on_m_ranks_under_another_unit_policy(tmp_path, name, n, policy, m, new_policy):
    path = str(tmp_path / "ckpt")
    saved = run_world(scenarios.save_then_continue, n, name, policy, path)[0]
    loaded = run_world(scenarios.load_then_continue, m, name, new_policy, path)[0]
    assert saved["units"] != loaded["units"] or n != m  # the layout really changed

    _assert_same_state(saved["model"], loaded["model"], "model")  # bit for bit
    opt_saved, opt_loaded = saved["optimizer"], loaded["optimizer"]
    assert opt_saved["param_groups"] == opt_loaded["param_groups"]
    assert opt_saved["state"].keys() == opt_loaded["state"].keys()
    for i in opt_saved["state"]:
        _assert_same_state(opt_saved["state"][i], opt_loaded["state"][i], f"optimizer state of parameter {i}")
    assert loaded["epoch"] == 7
    # training goes on as if never interrupted (only the reduction order of N vs M ranks differs)
    torch.testing.assert_close(torch.tensor(loaded["after"]), torch.tensor(saved["after"]), rtol=1e-5, atol=1e-6)


def test_consolidate_gives_a_plain_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    saved = run_world(scenarios.save_then_continue, 2, "gpt", BLOCKS, str(path))[0]
    out = tmp_path / "ckpt.full.ckpt"  # the default: beside the directory
    proc = subprocess.run([sys.executable, "-m", "lightning_shard.consolidate", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"load it in one process: YourLightningModule.load_from_checkpoint('{out}')" in proc.stdout
    full = torch.load(out, weights_only=True)
    _assert_same_state(saved["model"], full["state_dict"], "consolidated model")
    plain = TinyGPT()
    plain.load_state_dict(full["state_dict"])  # strict: every key, every shape
    assert full["epoch"] == 7
    optimizer = full["optimizer_states"][0]
    assert optimizer["param_groups"] == saved["optimizer"]["param_groups"]
    for i, state in saved["optimizer"]["state"].items():
        _assert_same_state(state, optimizer["state"][i], f"consolidated optimizer state {i}")
    opt = torch.optim.AdamW(scenarios.param_groups(plain), lr=1e-2)
    opt.load_state_dict(optimizer)  # an ordinary optimizer state dict


def _damaged_cases(path):
    shard = path / "__1_0.distcp"
    yield "missing", lambda: os.remove(shard), r"__1_0.distcp: missing"
    data = shard.read_bytes()
    yield "truncated", lambda: shard.write_bytes(data[: len(data) // 2]), r"__1_0.distcp: \d+ bytes, expected \d+ \(truncated"
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    yield "corrupted", lambda: shard.write_bytes(bytes(flipped)), r"__1_0.distcp: contents do not match .*corrupted"
    yield "unfinished", lambda: os.remove(path / "manifest.json"), r"not a complete lightning_shard checkpoint"


def test_damaged_or_foreign_checkpoints_fail_clearly_on_every_rank(tmp_path):
    path = tmp_path / "ckpt"
    run_world(scenarios.save_then_continue, 2, "gpt", BLOCKS, str(path))
    pristine = {p.name: p.read_bytes() for p in path.iterdir()}
    for what, damage, message in _damaged_cases(path):
        damage()
        errors = run_world(scenarios.load_expecting_error, 2, "gpt", PACKED, str(path))
        for error in errors:
            assert error is not None and __import__("re").search(message, error), (what, error)
        for name, data in pristine.items():  # repair for the next case
            (path / name).write_bytes(data)
    errors = run_world(scenarios.load_expecting_error, 2, "odd", {}, str(path))  # another model
    assert all("does not fit the model" in e and "missing from the checkpoint [a.bias, a.weight" in e for e in errors)


def test_checkpoint_metadata_is_never_unpickled_freely(tmp_path):
    path = tmp_path / "ckpt"
    run_world(scenarios.save_then_continue, 1, "odd", {}, str(path))
    from lightning_shard.checkpoint.files import CheckpointError, SafeReader

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    import pickle

    (path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match=r"refers to (posix|os)\.system, which is not allowed"):
        SafeReader(str(path)).read_metadata()
    assert not (tmp_path / "pwned").exists()
    assert Odd  # the model the checkpoint belongs to


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    result = run_world(scenarios.save_twice_rank1_dies_in_the_second, 2, str(path), may_die=(1,), pg_timeout=8)[0]
    assert result["error"] is not None and "saving the checkpoint" in result["error"]  # rank 0: an error, no hang
    assert (tmp_path / "last.ckpt.partial").is_dir()  # the interrupted save, never under the checkpoint's name
    loaded = run_world(scenarios.load_model_only, 2, str(path))[0]
    _assert_same_state(result["first"], loaded, "previous checkpoint")
    with pytest.raises(AssertionError, match="not a complete lightning_shard checkpoint"):
        run_world(scenarios.load_model_only, 1, str(tmp_path / "last.ckpt.partial"))


def test_a_kill_between_the_two_renames_still_finds_a_complete_checkpoint(tmp_path):
    from lightning_shard.checkpoint import files

    path = tmp_path / "last.ckpt"
    run_world(scenarios.save_then_continue, 1, "odd", {}, str(path))
    os.rename(path, files.previous_path(path))  # first rename done, second never happened
    assert files.resolve(path) == files.previous_path(path)
    run_world(scenarios.load_then_continue, 1, "odd", {}, str(path))


def test_a_save_stopped_while_it_moves_the_new_checkpoint_in_leaves_one_where_lightning_looks(tmp_path, monkeypatch):
    """On Linux the new checkpoint directory takes the old one's place in one step (``renameat2``'s exchange): there
    is no moment without ``last.ckpt``, which is all Lightning's ``ckpt_path="last"`` looks for (with two renames, a
    stop between them left ``last.ckpt.partial`` and ``last.ckpt.previous``: "no last checkpoint", and a fresh run)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_shard.checkpoint import files

    if getattr(files._libc(), "renameat2", None) is None:
        pytest.skip("no renameat2 here: two renames, which an explicit path still resolves (test above)")
    renames, rename = [], os.rename

    class Stopped(BaseException):  # a kill, as far as the save can tell
        pass

    def stopped_at_the_second(source, target):
        renames.append(source)
        if len(renames) == 2:
            raise Stopped
        rename(source, target)

    path = tmp_path / "last.ckpt"
    for content in ("old", "new"):
        partial = files.begin(path)
        (partial / files.MANIFEST).write_text(content)
        renames.clear()
        monkeypatch.setattr(files.os, "rename", stopped_at_the_second)
        with contextlib.suppress(Stopped):
            files.commit(partial, path)
        monkeypatch.undo()
    assert (path / files.MANIFEST).read_text() == "new" and sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(None) == {str(path)}


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_pretrained_weights_load_into_a_sharded_model_slice_by_slice(tmp_path, suffix):
    torch.manual_seed(5)
    reference = TinyGPT()
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        state = {k: v for k, v in reference.state_dict().items() if k != "head.weight"}  # tied: stored once
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save(reference.state_dict(), path)
    loaded = run_world(scenarios.load_pretrained_file, 3, str(path), PACKED)[0]
    assert loaded["result"] == ([], [])
    _assert_same_state(reference.state_dict(), loaded["model"], "pretrained")


def test_pretrained_weights_of_another_model_are_refused_with_names(tmp_path):
    path = tmp_path / "odd.pt"
    torch.save(Odd().state_dict(), path)
    with pytest.raises(AssertionError, match=r"do not fit the model: missing \['wpe', 'wte.weight', 'blocks.0.ln1.weight'"):
        run_world(scenarios.load_pretrained_file, 2, str(path), PACKED)


def test_resumes_that_cannot_restore_the_optimizers_say_why(tmp_path):
    """A weights-only sharded checkpoint holds no optimizer states (it held an empty list, which Lightning took for
    states: resuming then failed on the LR schedulers' KeyError, not on Lightning's own message); a checkpoint of
    another number of optimizers is refused, not restored into the first ones only."""
    result = run_world(scenarios.resumes_that_cannot_restore_the_optimizers, 2, str(tmp_path), timeout=300)[0]
    assert "optimizer_states" not in result["meta_keys"] and "optimizer_states" not in result["consolidated_keys"]
    assert "contains only the model" in result["weights_only"] and "save_weights_only" in result["weights_only"]
    assert "holds 1 optimizer state(s) and `configure_optimizers` returns 2" in result["other_count"]
