"""QLoRA (issue 48): bitsandbytes 4-bit bases sharded as bytes, their quantization state travelling with the unit,
exact against one process. bitsandbytes runs 4-bit quantization and Linear4bit's forward and backward on the CPU."""

from __future__ import annotations


import pytest
import torch

from tests import planted_scenarios
from tests import qlora_scenarios as scenarios
from tests.mixed_scenarios import write_base
from tests.qlora_scenarios import same_bits
from tests.world import run_world

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "base"
    write_base(str(folder))
    return folder


@pytest.mark.parametrize("world", [2, 3])
def test_qlora_matches_one_process_for_every_quantization(base, world):
    results = run_world(scenarios.qlora_against_one_process, world, str(base), scenarios.QUANT_CASES, timeout=800)[0]
    assert [r["case"] for r in results] == scenarios.QUANT_CASES
    for r in results:
        tag = f"{r['case']} on {world} ranks"
        # the 4-bit layers compute with a real Params4bit gathered with its quantization state (bitsandbytes' kernels)
        assert r["gathered_classes"] == ["Parameter", "Params4bit"], tag
        # packed weights never get a gradient, optimizer state or weight decay (the optimizer was given them)
        assert r["graded"] == ["torch.float32"] and r["stateless"], tag
        # the packed bytes and their quantization state, gathered into bitsandbytes' own state-dict entries, are the
        # one process's and as they were loaded, bit for bit (bf16 storage: NaN patterns among them)
        nested = r["case"][2]
        assert len(r["quant_keys"]) == 14 * (6 if nested else 4), tag  # weight, absmax, quant_map (+ nested), blob
        for key, value in r["ref_quant"].items():
            assert same_bits(r["quant"][key], value) and same_bits(value, r["before"][key]), (tag, key)
        losses, reference = torch.tensor(r["losses"]), torch.tensor(r["ref_losses"])
        assert set(r["adapters"]) == set(r["ref_adapters"]) and len(r["adapters"]) == 12, tag
        if world == 2:  # the gradient of two ranks' halves is one process's (a + b either way): to the bit
            assert torch.equal(losses, reference), (tag, losses, reference)
            for key, value in r["ref_adapters"].items():
                assert torch.equal(r["adapters"][key], value), (tag, key)
        else:  # three gradients summed in another order: 1 ulp, which AdamW's normalisation scales up on near-zero
            # gradients (measured: losses within 8.6e-6, adapters within 6.8e-5 after 5 steps at lr 1e-2)
            torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0, msg=tag)
            for key, value in r["ref_adapters"].items():
                torch.testing.assert_close(r["adapters"][key], value, rtol=1e-4, atol=2e-4, msg=f"{tag} {key}")


@pytest.mark.parametrize("saved, resumed", [(2, 3), (3, 2)])
def test_a_sharded_qlora_checkpoint_resumes_on_another_number_of_ranks(base, tmp_path, saved, resumed):
    case = ("nf4", "bfloat16", True)
    at_save = run_world(scenarios.qlora_save, saved, str(base), case, str(tmp_path / "ckpt"), timeout=300)[0]
    result = run_world(scenarios.qlora_resume, resumed, str(base), case, str(tmp_path / "ckpt"), saved,
                       timeout=300)[0]
    quant = [k for k in result["reference"] if "lora_" not in k and ("_proj.weight" in k or "base_layer" in k)]
    assert len(quant) == 14 * 6
    for key in quant:  # loaded over other bytes, bit for bit, then untouched by training
        assert same_bits(result["loaded"][key], at_save[key]) and same_bits(result["resumed"][key], at_save[key]), key
        assert same_bits(at_save[key], result["reference"][key]), key
    adapters = [k for k in result["reference"] if "lora_" in k]
    for key in adapters:
        assert torch.equal(result["loaded"][key], at_save[key]), key
        # the two steps after the resume, and (saved on 3 ranks) the three before, summed three gradients in another
        # order than one process: 1 ulp, scaled up by AdamW on near-zero gradients
        torch.testing.assert_close(result["resumed"][key], result["reference"][key], rtol=1e-4, atol=2e-4, msg=key)


@pytest.mark.parametrize("world", [2, 3])
def test_load_pretrained_quantizes_each_ranks_part_as_bitsandbytes_quantizes_the_whole(base, tmp_path, world):
    prequantized = tmp_path / "bnb-4bit"
    scenarios.write_prequantized(str(base), str(prequantized), ("nf4", "uint8", True))
    cases = [("nf4", "uint8", True, None, True), ("fp4", "bfloat16", False, None, False),
             ("nf4", "uint8", True, str(prequantized), True)]
    results = run_world(scenarios.load_by_parts, world, str(base), cases, timeout=600)
    config = scenarios.llama_config()
    largest = config.vocab_size * config.hidden_size  # the embedding: every rank reads its rows
    for rank_results in results:
        for case, r in zip(cases, rank_results):
            # a model built on the meta device, sharded, then loaded: every packed weight, absmax, nested state and
            # code table (and the bf16 weights) bit for bit those of from_pretrained quantizing in one process
            assert r["keys"] and len(r["same"]) == r["total"] == (91 if case[2] else 63), (case, r)
            # what loading allocates besides the shards it fills: one weight's part at a time (read, cast, quantized:
            # a few bytes per element), never the model (measured: 3.5-6.7 KiB here; the fp32 file is 98 KiB)
            assert r["peak"] <= 20 * (largest // world + config.hidden_size), (case, r["peak"])


def test_qlora_exports_an_adapter_and_a_merged_bf16_folder_as_peft_makes_them(base, tmp_path):
    result = run_world(scenarios.qlora_export, 2, str(base), str(tmp_path), ("nf4", "bfloat16", True), timeout=400)[0]
    # the adapter onto a 4-bit base in one process (PeftModel.from_pretrained): the sharded model's logits, exactly
    assert torch.equal(result["adapter"], result["sharded"])
    # merged: 4-bit weights dequantized, the adapter merged in, bf16 files from_pretrained loads without
    # bitsandbytes; every weight and the logits those of peft merging onto the dequantized base in one process
    assert result["differ"] == [] and result["total"] == 21 and result["dtypes"] == ["torch.bfloat16"]
    assert torch.equal(result["merged"], result["reference"])
    assert "quantization_config" not in result["config"] and result["config"]["dtype"] == "bfloat16"


def test_qlora_with_hf_gradient_checkpointing_or_activation_checkpointing_trains_the_same(base):
    results = run_world(scenarios.qlora_checkpointing, 2, str(base), timeout=400)
    for by_mode in results:
        assert by_mode["hf"]["checkpointed"] and not by_mode["none"]["checkpointed"]
        for mode in ("hf", "units"):  # recomputed in backward: the same numbers, to the bit
            assert by_mode[mode]["losses"] == by_mode["none"]["losses"], mode
            for key, value in by_mode["none"]["adapters"].items():
                assert torch.equal(by_mode[mode]["adapters"][key], value), (mode, key)


def test_packed_bytes_that_read_as_nan_inf_and_subnormals_survive_everything_bit_for_bit(base, tmp_path):
    from lightning_shard.checkpoint.consolidate import consolidate

    result = run_world(planted_scenarios.planted_bytes, 2, str(base), str(tmp_path), timeout=600)[0]
    planted = result["planted"]
    assert len(planted) == 14
    sample = next(iter(planted.values())).view(torch.bfloat16)  # what a float cast would have seen
    assert sample.isnan().any() and sample.isinf().any() and (sample.abs() < torch.finfo(torch.bfloat16).tiny).any()
    state = consolidate(tmp_path / "sharded")["state_dict"]  # in this process, as its command runs
    result["points"]["consolidated"] = {name: state[name].contiguous().view(torch.uint8) for name in planted}
    assert sorted(result["points"]) == ["consolidated", "full checkpoint", "offloaded", "sharded checkpoint",
                                        "trained"]
    for point, packed in result["points"].items():
        for name, value in planted.items():
            assert torch.equal(packed[name], value), (point, name)
    # gathered (under fp16 mixed precision: a cast there would rewrite every one of them), offloaded or not: the
    # weight each 4-bit layer computed with
    for label in ("gathered", "gathered offloaded"):
        for name, value in planted.items():
            assert torch.equal(result["seen"][label][name], value), (label, name)
    # the merged export writes them dequantized: bitsandbytes' dequantization of the planted bytes, exactly
    assert len(result["exported"]) == 8
    for name, (written, dequantized) in result["exported"].items():
        assert torch.equal(written, dequantized), name


def _four_bit_layer(bias: bool, storage: torch.dtype = torch.uint8):
    from bitsandbytes.nn import Linear4bit

    torch.manual_seed(0)
    layer = Linear4bit(128, 64, bias=bias, compute_dtype=torch.bfloat16, quant_type="nf4", quant_storage=storage)
    return torch.nn.Sequential(layer.to("cpu"), torch.nn.Linear(64, 8))  # quantized by the move, as bitsandbytes does


def test_what_cannot_be_sharded_exactly_is_refused_naming_it():
    from lightning_shard.engine.runtime.averaging import AveragedShards, ema_update
    from lightning_shard.engine.shard_module import shard_module

    # bitsandbytes casts an fp32 bias to its bf16 compute dtype in place at the first forward: the gathered bias
    # would be detached from the buffer that gathers refill
    with pytest.raises(ValueError, match="has a torch.float32 bias .* and compute dtype torch.bfloat16"):
        shard_module(_four_bit_layer(bias=True))
    trainable = _four_bit_layer(bias=False, storage=torch.bfloat16)
    trainable[0].weight.requires_grad_(True)
    with pytest.raises(ValueError, match="packed 4-bit weight with requires_grad=True"):
        shard_module(trainable)
    from bitsandbytes.nn import Linear8bitLt

    with pytest.raises(ValueError, match="Int8Params, a quantized parameter whose state this strategy does not shard"):
        shard_module(torch.nn.Sequential(Linear8bitLt(64, 64, has_fp16_weights=False).to("cpu")))
    model = _four_bit_layer(bias=False)
    runtime = shard_module(model)
    with pytest.raises(ValueError, match="hold parameters of several dtypes .* averaging their weights is not supported"):
        AveragedShards(runtime, ema_update(0.9))
    model(torch.randn(2, 128))  # the packed weight frozen: fine
    frozen = _four_bit_layer(bias=False, storage=torch.bfloat16)
    runtime = shard_module(frozen)
    next(p for p in frozen.parameters() if p.dtype == torch.bfloat16).requires_grad_(True)  # its shard, unfrozen
    with pytest.raises(RuntimeError, match="are packed quantized bytes and were set to require gradients"):
        frozen(torch.randn(2, 128))
