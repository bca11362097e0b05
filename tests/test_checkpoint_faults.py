"""A save that fails or is killed half-way leaves the previous checkpoint whole and loadable."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_shard import ShardStrategy

pytestmark = pytest.mark.timeout(120)


class FailingIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
        raise OSError("No space left on device")


def test_failed_save_keeps_the_previous_checkpoint_and_the_next_save_works(tmp_path):
    path = tmp_path / "last.ckpt"
    strategy = ShardStrategy(state_dict_type="full")
    strategy.save_checkpoint({"w": torch.ones(3)}, path)
    strategy.checkpoint_io = FailingIO()
    with pytest.raises(OSError, match=r"saving the checkpoint .*last.ckpt.* failed \(No space left on device\).*intact"):
        strategy.save_checkpoint({"w": torch.zeros(3)}, path)
    assert torch.load(path, weights_only=True)["w"].sum() == 3
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # no partial file left behind
    strategy.checkpoint_io = TorchCheckpointIO()
    strategy.save_checkpoint({"w": torch.zeros(3)}, path)
    assert torch.load(path, weights_only=True)["w"].sum() == 0


SLOW_WRITER = """
import io, sys, time, torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning_shard import ShardStrategy

class SlowIO(TorchCheckpointIO):  # a slow filesystem: the kill lands while the file is half written
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            print("half written", flush=True)
            time.sleep(60)
            f.write(data[len(data) // 2 :])

strategy = ShardStrategy(state_dict_type="full")
strategy.checkpoint_io = SlowIO()
strategy.save_checkpoint({"w": torch.zeros(1000)}, sys.argv[1])
"""


def test_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    ShardStrategy(state_dict_type="full").save_checkpoint({"w": torch.ones(3)}, path)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "half written"
    proc.send_signal(signal.SIGKILL)  # kill -9 in the middle of writing
    proc.wait()
    assert torch.load(path, weights_only=True)["w"].sum() == 3  # the previous checkpoint, whole
