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


# -- model-level init (torchtitan's convention): `init_weights()`, or a `reset_parameters()` over children --

def _gpt(device):
    from lightning_shard.app.models.gpt import GPT

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(vocab_size=64, width=32, depth=2, heads=2, max_seq=16)


def _shard_gpt(model):
    from lightning_shard.app.models.gpt import Block
    from lightning_shard.checkpoint.full import full_state_dict

    runtime = shard_module(model, units=[Block], device=torch.device("cpu"))
    return full_state_dict(runtime, rank0_only=False)


def test_a_meta_gpt_gets_its_model_level_init():
    """GPT.reset_parameters (normal 0.02 over its children's weights) takes effect, not nn.Embedding's own N(0, 1)."""
    state = _shard_gpt(_gpt("meta"))
    cpu = _gpt("cpu").state_dict()
    assert state.keys() == cpu.keys()
    scaled = 0.02 / (2 * 2) ** 0.5  # proj and mlp output weights: 0.02 / sqrt(2 * depth)

    def std(sd, suffixes):
        return torch.cat([v.reshape(-1) for k, v in sd.items() if k.endswith(suffixes)]).std().item()

    for sd in (state, cpu):  # the same distribution as building on CPU
        assert sd["wte.weight"].std().item() == pytest.approx(0.02, rel=0.05)
        assert sd["wpe.weight"].std().item() == pytest.approx(0.02, rel=0.1)
        assert std(sd, ("qkv.weight", "mlp.0.weight")) == pytest.approx(0.02, rel=0.05)
        assert std(sd, ("proj.weight", "mlp.2.weight")) == pytest.approx(scaled, rel=0.05)
        assert all((v == 0).all() for k, v in sd.items() if k.endswith("bias"))
        assert all((v == 1).all() for k, v in sd.items() if k.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")))
    assert state["head.weight"] is state["wte.weight"] or torch.equal(state["head.weight"], state["wte.weight"])


def test_model_level_init_touches_only_what_was_on_meta():
    """A block built on meta among real ones: the GPT's init reaches that block only; the rest keeps its values."""
    from lightning_shard.app.models.gpt import Block

    model = _gpt("cpu")
    with torch.device("meta"):
        model.blocks[1] = Block(32, 2)
    before = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("blocks.1.")}
    state = _shard_gpt(model)
    for k, v in before.items():
        assert torch.equal(state[k], v), k
    assert state["blocks.1.attn.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.05)  # kaiming would be ~0.1
    assert all((v == 0).all() for k, v in state.items() if k.startswith("blocks.1.") and k.endswith("bias"))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def init_weights(self, value):  # torchtitan style: only the enclosing init knows its arguments
        nn.init.constant_(self.lin.weight, value)
        nn.init.zeros_(self.lin.bias)

    def forward(self, x):
        return self.lin(x)


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.layers = nn.ModuleList(_Layer() for _ in range(3))


class _Titan(_Stack):
    def __init__(self):
        super().__init__()
        self.register_buffer("freqs", torch.zeros(4), persistent=False)

    def init_weights(self, buffer_device=None):
        with torch.device(buffer_device or self.freqs.device):
            self.freqs = torch.arange(4.0) * 2
        nn.init.constant_(self.embed.weight, 0.5)
        for i, layer in enumerate(self.layers):
            layer.init_weights(i + 1.0)

    def forward(self, idx):
        x = self.embed(idx) + self.freqs
        for layer in self.layers:
            x = layer(x)
        return x


def test_torchtitan_init_weights_convention():
    with torch.device("meta"):
        model = _Titan()
    shard_module(model, units=[_Layer], device=torch.device("cpu"))
    from lightning_shard.checkpoint.full import full_state_dict

    state = full_state_dict(model._shard_runtime, rank0_only=False)
    assert (state["embed.weight"] == 0.5).all()
    for i in range(3):
        assert (state[f"layers.{i}.lin.weight"] == i + 1.0).all() and (state[f"layers.{i}.lin.bias"] == 0).all()
    assert torch.equal(model.freqs, torch.tensor([0.0, 2.0, 4.0, 6.0]))


class _NeedsArgs(_Stack):
    def init_weights(self, std):  # noqa: D102 - nothing can call it
        nn.init.normal_(self.embed.weight, std=std)


class _ReadsAnotherUnit(_Stack):
    def init_weights(self):
        self.layers[0].lin.weight.copy_(self.layers[1].lin.weight)  # layer 1 is another unit: no values


class _Replaces(_Stack):
    def init_weights(self):
        self.embed.weight = nn.Parameter(torch.zeros(5, 4))


class _Gain(nn.Module):
    """No reset_parameters: left to the enclosing init, which forgets it."""

    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.ones(4))


class _Forgets(_Stack):
    def __init__(self):
        super().__init__()
        self.gain = _Gain()

    def init_weights(self):
        nn.init.normal_(self.embed.weight)


@pytest.mark.parametrize("cls, match", [
    (_NeedsArgs, r"module '<root>' \(_NeedsArgs\).*`init_weights\(std\)` needs arguments"),
    (_ReadsAnotherUnit, r"`_ReadsAnotherUnit.init_weights\(\)` of module '<root>'.*NotImplementedError.*never reading"),
    (_Replaces, r"`_Replaces.init_weights\(\)` of module '<root>' replaced parameter 'embed.weight'"),
    (_Forgets, r"Cannot materialise \['gain.g'\] from the meta device: no init wrote"),  # was uninitialised memory
])
def test_a_model_level_init_that_cannot_be_honoured_is_refused(cls, match):
    with torch.device("meta"):
        model = cls()
    with pytest.raises(ValueError, match=match):
        shard_module(model, units=[_Layer], device=torch.device("cpu"))


def test_a_lightning_module_wrapping_a_meta_gpt():
    """`configure_model` building `self.model = GPT(...)`: the GPT's init is that of a non-root module."""
    import lightning as L

    class Wrapper(L.LightningModule):
        def configure_model(self):
            self.model = _gpt("meta")

    wrapper = Wrapper()
    wrapper.configure_model()
    state = _shard_gpt(wrapper)
    assert state["model.wte.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert all((v == 0).all() for k, v in state.items() if k.endswith("bias"))


def test_hf_llama_on_meta_gets_its_init_in_every_unit():
    """HF's init marks each module it initialised (``_is_hf_initialized``) and skips it next time: run once per
    unit, it used to leave every unit after the first with torch's default init (std ~0.1, embedding 1.0)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    shard_module(model, units=["LlamaDecoderLayer"], device=torch.device("cpu"))
    from lightning_shard.checkpoint.full import full_state_dict

    state = full_state_dict(model._shard_runtime, rank0_only=False)
    weights = [k for k, v in state.items() if v.dim() == 2]
    assert len(weights) == 3 * 7 + 2  # 7 projections per layer, the embedding and the (untied) head
    for name in weights:
        assert state[name].std().item() == pytest.approx(0.02, rel=0.15), name
