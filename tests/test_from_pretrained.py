"""``lightning_shard.from_pretrained``: a model built on the meta device as transformers' ``from_pretrained`` builds
it, sharded, then loaded by slices, is ``from_pretrained``'s model bit for bit (4-bit and bf16, with and without
peft's ``prepare_model_for_kbit_training``)."""

from __future__ import annotations

import pytest
import torch

from tests import from_pretrained_scenarios as scenarios
from tests.world import run_world

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.timeout(600)

BF16 = torch.bfloat16
# every family (Llama, Qwen2 with biases, a tied head), nf4 and fp4, double quantization on and off, prepared for
# k-bit training or not; bf16 and the folder's own dtype unquantized; a pre-quantized folder
CASES = [
    dict(model="llama", quant="nf4", double=True, dtype=BF16, prepare=True),
    dict(model="llama", quant="fp4", double=False, dtype=BF16, prepare=False),
    dict(model="qwen2", quant="fp4", double=True, dtype=BF16, prepare=False),
    # (prepared, Qwen2's biases are float32: bitsandbytes would cast them to a bf16 compute dtype in place, which
    # sharding refuses, naming the fix; a float32 compute dtype is one)
    dict(model="qwen2", quant="nf4", double=False, dtype=BF16, prepare=True, compute=torch.float32),
    dict(model="tied", quant="nf4", double=False, dtype=BF16, prepare=True),
    dict(model="tied", quant="fp4", double=True, dtype=BF16, prepare=False),
    dict(model="llama", quant=None, double=False, dtype=BF16, prepare=True),
    dict(model="qwen2", quant=None, double=False, dtype=BF16, prepare=False),
    dict(model="tied", quant=None, double=False, dtype="auto", prepare=False),
    dict(model="llama-bnb", quant=None, double=False, dtype=BF16, prepare=True),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("folders")
    scenarios.write_folders(str(root))
    return root


def test_built_on_meta_sharded_and_loaded_is_from_pretrained_bit_for_bit(folders):
    results = run_world(scenarios.built_against_from_pretrained, 2, str(folders), CASES, timeout=500)
    for rank_results in results:
        assert [r["case"] for r in rank_results] == CASES
        for r in rank_results:
            tag = r["case"]
            # every state-dict entry (packed bytes, absmax, code tables, nested state, the blob holding the offset,
            # dtype and shape; norms, embeddings, the head kept in full precision, biases) to the bit
            assert r["keys"] and r["differ"] == [] and r["total"] > 20, (tag, r["differ"][:4])
            # the buffers from_pretrained computes rather than loads (the rotary inv_freq, float32), the class,
            # dtype and trainability of every parameter, the mode, the quantizer's marks and the config
            assert r["buffers_differ"] == [] and r["described"], (tag, r["buffers_differ"], r["described_diff"])
            assert r["packed"] == (14 if tag["quant"] or tag["model"].endswith("bnb") else 0), tag
            assert r["logits"], (tag, r["logits_gap"])


def test_outside_the_meta_device_it_is_transformers_from_pretrained(folders):
    import lightning_shard
    from transformers import AutoModelForCausalLM

    model = lightning_shard.from_pretrained(folders / "qwen2", dtype=BF16)
    reference = AutoModelForCausalLM.from_pretrained(folders / "qwen2", dtype=BF16)
    assert not any(p.is_meta for p in model.parameters()) and not model.training
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.state_dict().items())


def test_what_it_cannot_build_is_refused_naming_it(folders, tmp_path):
    import lightning_shard
    from lightning_shard.checkpoint.files import CheckpointError
    from transformers import AutoModelForSequenceClassification

    with pytest.raises(ValueError, match="dtype='int8'; allowed: 'auto', a floating torch.dtype"):
        lightning_shard.from_pretrained(folders / "llama", dtype="int8")
    with pytest.raises(FileNotFoundError, match="is not a Hugging Face model folder"):
        lightning_shard.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = lightning_shard.from_pretrained(folders / "llama", model_class=AutoModelForSequenceClassification)
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.score.weight.is_meta
    with pytest.raises(CheckpointError, match="holds no model built by lightning_shard.from_pretrained"):
        lightning_shard.load_pretrained(torch.nn.Linear(2, 2))
