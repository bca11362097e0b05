"""Big-model init: a model built on the meta device (``configure_model`` or ``init_module(empty_init=True)``)
is materialised unit by unit, so a rank's memory stays near its 1/N share of the model."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_shard.engine.shard_module import shard_module
from tests.models import TinyGPT

APP = os.path.join(os.path.dirname(__file__), "meta_init_app.py")
pytestmark = pytest.mark.timeout(600)


def run_app(out, *args):
    out.mkdir(parents=True, exist_ok=True)
    # a fixed mmap threshold makes the allocator return freed tensors to the OS, so peak RSS follows live tensors
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, APP, "--out", str(out), *args], capture_output=True, text=True,
                          timeout=500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out / "meta_init.pt", weights_only=True)


def test_each_rank_materialises_only_its_shards(tmp_path):
    three = run_app(tmp_path / "three", "--devices", "3")  # configure_model on meta
    one = run_app(tmp_path / "one", "--devices", "1", "--init-module")  # trainer.init_module(empty_init=True)
    model_mb = three["model_mb"]
    assert model_mb > 380
    # per rank: 1/3 of the model plus one unit in flight; building it whole would need the full model
    for peak in three["peak_setup_mb"]:
        assert model_mb / 3 < peak < 0.55 * model_mb, (peak, model_mb)
    assert three["meta_left"] == [] and one["meta_left"] == []
    # the same values whatever the world size or the way the model was built on meta: bit for bit
    assert three["fingerprint"] == one["fingerprint"]
    # and they are the modules' reset_parameters() values
    stats = three["stats"]
    assert stats["net.5.norm.weight"] == (1.0, 0.0) and stats["net.5.norm.bias"] == (0.0, 0.0)
    assert stats["net.5.up.weight"][1] == pytest.approx(1 / (3 * 1024) ** 0.5, rel=0.02)  # kaiming uniform, a=sqrt(5)
    assert all(torch.isfinite(torch.tensor(three["losses"])))


def test_a_meta_module_without_reset_parameters_is_named():
    with torch.device("meta"):
        model = TinyGPT()  # its `wpe` is a bare nn.Parameter: nothing knows how to initialise it
    with pytest.raises(ValueError, match=r"module '<root>' \(TinyGPT\).*\['wpe'\].*reset_parameters"):
        shard_module(model, device=torch.device("cpu"))


def test_ties_survive_materialisation():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 6)
            self.body = nn.Linear(6, 6)
            self.head = nn.Linear(6, 11, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(self.body(self.embed(x)))

    with torch.device("meta"):
        model = Tied()
    runtime = shard_module(model, device=torch.device("cpu"))
    tied = [slot.names for unit in runtime.units for slot in unit.storage.slots if len(slot.names) > 1]
    assert tied == [("embed.weight", "head.weight")]
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 11) and torch.isfinite(out).all()
