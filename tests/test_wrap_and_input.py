"""Unit planning and bad input: clear errors at construction, naming the option and allowed values."""

import copy

import pytest
import torch
from torch import nn

from lightning_shard import ShardStrategy, shard_module
from lightning_shard.engine.plan.plan import plan_units
from tests import models


def unit_names(model, **kwargs):
    return [plan.name for plan in plan_units(model, **kwargs)]


def test_default_policy_makes_each_repeated_block_a_unit():
    assert unit_names(models.TinyGPT()) == ["blocks.0", "blocks.1", "blocks.2", "<root>"]


def test_units_by_class_and_by_name_agree():
    model = models.TinyGPT()
    assert unit_names(model, units=[models.Block]) == unit_names(model, units=["Block"])


def test_tied_weight_split_across_units_moves_to_the_common_unit():
    model = models.SplitTiedGPT()
    plans = plan_units(model, units=["Embed", "Head", "Block"])
    root = plans[-1]
    tied = [locs for p, locs in root.params if p is model.embed.table.weight]
    assert tied == [[("embed.table", "weight"), ("out.proj", "weight")]]
    # the Embed unit lost its only parameter, so it is no unit at all
    assert "embed" not in [p.name for p in plans]


def test_unit_size_packs_consecutive_siblings_within_the_budget():
    model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(6)])  # 110 parameters each
    plans = plan_units(model, unit_size=250)
    assert [p.members for p in plans[:-1]] == [["0", "1"], ["2", "3"], ["4", "5"]]
    assert all(p.numel() <= 250 for p in plans[:-1])
    assert plans[-1].numel() == 0


def test_min_unit_size_merges_consecutive_sibling_units():
    model = models.TinyGPT(n_blocks=5)  # 2,072 parameters per block
    plans = plan_units(model, min_unit_size=4000)
    assert [p.members for p in plans[:-1]] == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "blocks.4"]]
    # only within one container: the head, a child of the model called after the blocks, stays apart
    split = models.SplitTiedGPT()
    merged = plan_units(split, units=["Embed", "Head", "Block"], min_unit_size=10**9)
    assert [p.members for p in merged[:-1]] == [["blocks.0", "blocks.1", "blocks.2"], ["out"]]
    assert sorted(id(p) for plan in merged for p, _ in plan.params) == sorted({id(p) for p in split.parameters()})
    # never above unit_size
    packed = plan_units(models.TinyGPT(n_blocks=4), unit_size=5000, min_unit_size=5000)
    assert [p.members for p in packed if p.members[0].startswith("blocks")] == [["blocks.0", "blocks.1"],
                                                                               ["blocks.2", "blocks.3"]]
    assert all(p.numel() <= 5000 for p in packed[:-1])


def test_unit_size_never_splits_a_torch_builtin():
    plans = plan_units(models.Block(14), unit_size=50)
    assert "attn.out_proj" not in [m for p in plans for m in p.members]


def test_unit_size_packs_the_modules_of_a_module_list_not_the_list():
    """A ``ModuleList`` is never called: as a unit's member, its unit would never be gathered."""
    model = nn.Module()
    model.first, model.experts, model.last = nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)] * 1 + [nn.Linear(4, 4)]), \
        nn.Linear(4, 4)  # 20 parameters each
    assert [p.members for p in plan_units(model, unit_size=50)[:-1]] == [["first"], ["experts.0", "experts.1"], ["last"]]


@pytest.mark.parametrize("kwargs", [{"units": [nn.Linear]}, {"units": ["Linear"]}, {"unit_size": 40}])
def test_peft_adapter_layers_are_never_cut_apart(kwargs):
    """DoRA (and LoRA on a parameter) read their adapters' and base layer's weights without calling them: nothing
    inside an adapter layer is a unit of its own, whatever the plan asks."""
    peft = pytest.importorskip("peft")
    base = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0", "2"], use_dora=True))
    members = [m for p in plan_units(model, **kwargs)[:-1] for m in p.members]
    assert members and not [m for m in members if ".base_layer" in m or ".lora_" in m], members


def test_every_parameter_is_owned_exactly_once():
    model = models.TinyGPT()
    for kwargs in ({}, {"unit_size": 300}, {"units": ["LayerNorm", "Block"]}):
        owned = [id(p) for plan in plan_units(model, **kwargs) for p, _ in plan.params]
        assert sorted(owned) == sorted({id(p) for p in model.parameters()})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sharding": "zero3"}, r"`sharding` must be one of 'full', 'grad_op', 'hybrid', 'none'; got 'zero3'"),
        ({"unit_size": 0}, r"`unit_size` must be a positive int"),
        ({"unit_size": 2.5}, r"`unit_size` must be a positive int"),
        ({"unit_size": True}, r"`unit_size` must be a positive int"),
        ({"units": ["Block"], "unit_size": 100}, r"either `units` .* or `unit_size`"),
        ({"prefetch": -1}, r"`prefetch` must be an int >= 0"),
        ({"min_unit_size": 0}, r"`min_unit_size` must be a positive int"),
        ({"unit_size": 100, "min_unit_size": 200}, r"`min_unit_size` \(200\) is above `unit_size` \(100\)"),
        ({"timeout": "soon"}, r"`timeout` must be a timedelta or a number of seconds"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardStrategy(**kwargs)


def test_units_of_wrong_type_fail_at_construction():
    with pytest.raises(TypeError, match="`units` entries must be nn.Module classes or class names"):
        ShardStrategy(units=[42])


def test_unit_matching_nothing_is_an_error_naming_it():
    # a typo must not train the whole model unsharded
    with pytest.raises(ValueError, match=r"`units` entries \['Blok'\] match no module of TinyGPT; its classes with"
                                         r" parameters are \['Block', .*'Linear'"):
        plan_units(models.TinyGPT(), units=["Blok", "Block"])


def test_unsupported_precision_is_refused_when_the_trainer_is_built():
    import lightning as L

    with pytest.raises(ValueError, match="supported: '32-true'"):
        L.Trainer(strategy=ShardStrategy(), accelerator="cpu", devices=1, precision="64-true")


def test_registered_names():
    import lightning as L

    for name, sharding in [("lightning_shard", "full"), ("lightning_shard_grad_op", "grad_op"),
                           ("lightning_shard_hybrid", "hybrid"), ("lightning_shard_no_shard", "none")]:
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
        assert isinstance(trainer.strategy, ShardStrategy) and trainer.strategy.sharding == sharding


def test_single_process_module_matches_unsharded_training():
    torch.manual_seed(0)
    reference = models.TinyGPT()
    sharded = models.TinyGPT()
    sharded.load_state_dict(reference.state_dict())
    shard_module(sharded)
    g = torch.Generator().manual_seed(0)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded)]
    for step in range(5):
        batch = models.TinyGPT.batch(g, 4)
        for model, opt in zip((reference, sharded), opts):
            models.TinyGPT.loss(model, batch, step).backward()
            opt.step()
            opt.zero_grad()
    from lightning_shard.checkpoint.full import full_state_dict

    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full_state_dict(sharded._shard_runtime)[key], value)


def test_default_plan_on_real_models_gives_one_unit_per_layer_and_trains_exactly():
    pytest.importorskip("transformers")
    from tests import default_plan_scenarios
    from tests.world import run_world

    results = run_world(default_plan_scenarios.run, 2, timeout=300)
    layers = [f"transformer.{part}.layers.{i}" for part in ("encoder", "decoder") for i in range(2)]
    assert results[0]["lightning_transformer"] == {"units": layers + ["<root>"], "warnings": []}
    assert results[0]["hf_llama"] == {"units": ["model.layers.0", "model.layers.1", "<root>"], "warnings": []}
    # the root-heavy plan is named loudly, once (rank 0), with the fix
    (message,) = results[0]["root_heavy"]
    assert "root unit holds 100% of Sequential's 288 parameters (largest: 0.weight (64)," in message
    assert "E.g. `units=['Linear']` leaves 0% in the root; 'Linear' matches 0, 1, 2, 3" in message
    assert "`unit_size=`" in message
    assert results[1]["root_heavy"] == []


def test_plan_is_reported_as_a_count_and_a_table_by_kind():
    from lightning_shard.lightning.plan_summary import plan_listing, plan_summary

    runtime = shard_module(models.TinyGPT())
    assert plan_summary(runtime, "full", 2).splitlines() == [
        "lightning_shard: sharding='full', 4 units over 2 ranks, 6,888 parameters",
        "  3 x Block   2,072 parameters each",
        "  1 x <root>  672 parameters",
    ]
    assert plan_listing(runtime).splitlines()[0] == "  blocks.0: 2,072 parameters"
    from lightning_shard.app.models.gpt import GPT

    packed = shard_module(GPT(vocab_size=100, width=128, depth=4, heads=4), unit_size=140000)
    assert plan_summary(packed, "full", 2).splitlines()[1:3] == [  # unit_size packs siblings: one kind each
        "  1 x [2 Embedding]                        0.02M parameters",
        "  4 x [2 LayerNorm + CausalSelfAttention]  0.07M parameters each"]


def test_root_heavy_warning_suggests_units_that_take_the_largest_root_parameter_out():
    from lightning.pytorch.demos import LightningTransformer

    from lightning_shard.engine.plan.plan import root_heavy_warning

    model = LightningTransformer()  # Lightning's docs example: embedding and decoder are 91% of it
    message = root_heavy_warning(model, plan_units(model))
    assert "holds 91% of LightningTransformer's 14,635,678 parameters (largest: model.embedding.weight" in message
    # Embedding: the outermost module around the embedding that holds no unit (not the whole Transformer)
    assert ("E.g. `units=['Embedding', 'TransformerEncoderLayer', 'TransformerDecoderLayer']` leaves 46% in the"
            " root; 'Embedding' matches model.embedding, and") in message
    assert root_heavy_warning(models.TinyGPT(), plan_units(models.TinyGPT())) is None
    # a tied embedding stays in the root whatever the units: no advice that would not help
    from lightning_shard.app.models.gpt import GPT

    gpt = GPT(vocab_size=5000, width=64, depth=2, heads=2)
    message = root_heavy_warning(gpt, plan_units(gpt))
    assert message.endswith("The largest is one parameter tied between ['wte', 'head']: it stays in the root unit"
                            " whatever the plan (untie it to shard it).")


def test_default_plan_takes_the_blocks_an_hf_model_declares():
    transformers = pytest.importorskip("transformers")
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=16, d_ff=32, num_heads=2, d_kv=8, vocab_size=64))
    # T5Block (its _no_split_modules), not the encoder and decoder stacks, the outermost repeated blocks
    assert unit_names(t5) == [f"{part}.block.{i}" for part in ("encoder", "decoder") for i in range(2)] + ["<root>"]
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=64))
    bert_units = ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1"]
    assert unit_names(bert) == bert_units + ["<root>"]
    # an HF model beside the user's own blocks: each part gets its blocks
    combined = nn.ModuleDict({"bert": bert, "head": nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32), 2)})
    assert unit_names(combined) == [f"bert.{u}" for u in bert_units] + ["head.layers.0", "head.layers.1", "<root>"]


class _ReadsWeightDirectly(nn.Module):
    """Reads its position embedding as ``self.wpe.weight[:T]``, never calling ``wpe``; T == width, so the
    1-D shard a unit holds between uses broadcasts where the parameter would (no shape error to notice)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(16, width), nn.Embedding(width, width)
        self.head = nn.Linear(width, 16)

    def forward(self, ids):
        return self.head(self.wte(ids) + self.wpe.weight[: ids.shape[1]])


def test_a_parameter_read_directly_is_gathered_and_one_used_while_its_unit_is_not_gathered_stops_training():
    ids = torch.randint(0, 16, (2, 8))
    torch.manual_seed(0)
    model = _ReadsWeightDirectly()
    plain = copy.deepcopy(model)
    # wpe's module is never called: `self.wpe.weight` gathers its unit for the read (DeepSpeed's external parameters;
    # before: an error here, and before that, trained on with a wrong gradient, silently)
    shard_module(model, units=["Embedding"])
    model(ids).sum().backward()
    plain(ids).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad.reshape(-1), rtol=1e-6, atol=1e-7, msg=name)
    # a penalty over self.parameters() after forward reads the freed units' shards (no lookup by name gathers them)
    model = models.TinyGPT()
    shard_module(model)
    loss = model(torch.randint(0, 37, (2, 5))).float().mean()
    with pytest.raises(RuntimeError, match="'blocks.2.* was used while its unit was not gathered"):
        (loss + sum(p.pow(2).sum() for p in model.parameters())).backward()


def test_an_fp32_input_to_a_bf16_norm_under_cpu_autocast_is_named_and_fp32_gathers_train():
    """CPU autocast runs LayerNorm in its input's dtype: a unit whose first op is a norm, fed float32 features, meets
    its bf16 weights there. torch's "mixed dtype (CPU)" alone does not say why; the strategy says it, and what to do."""
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shard import MixedPrecision
    from tests.world import one_rank_here

    class PreNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.proj = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x):
            return x + self.proj(self.norm(x))

    class SpectralNormed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))

        def forward(self, x):
            return x + self.proj(x)

    class Lit(L.LightningModule):
        def __init__(self, block: type = PreNorm) -> None:
            super().__init__()
            self.blocks = nn.Sequential(block(), block())

        def training_step(self, batch, batch_idx):
            return self.blocks(batch[0]).float().square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(strategy, block: type = PreNorm):
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        with one_rank_here():
            trainer.fit(Lit(block), DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4))
        return trainer

    with pytest.raises(RuntimeError, match=r"under CPU autocast a unit computing in torch.bfloat16 met a float32 tensor"
                                           r".*mixed_precision=MixedPrecision\(\)") as raised:
        fit(ShardStrategy())
    assert "mixed dtype (CPU)" in str(raised.value.__cause__)
    assert fit(ShardStrategy(mixed_precision=MixedPrecision())).global_step == 2  # the advice works
    # spectral_norm's power iteration: its float32 buffers meet the bf16 weight in a matrix-vector product, which CPU
    # autocast does not cover (found by a review: torch's "addmv input tensors must have the same dtype" alone)
    with pytest.raises(RuntimeError, match=r"met a float32 tensor .* spectral_norm's") as raised:
        fit(ShardStrategy(), SpectralNormed)
    assert "must have the same dtype" in str(raised.value.__cause__)
    assert fit(ShardStrategy(mixed_precision=MixedPrecision()), SpectralNormed).global_step == 2


def test_sparse_embeddings_are_refused_at_setup_naming_them():
    from torch import nn

    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1), nn.EmbeddingBag(5, 4, sparse=True))
    with pytest.raises(ValueError, match=r"\['0', '2'\] make sparse gradients \(`sparse=True`\).*sparse=False"):
        shard_module(model)
    assert not hasattr(model, "_shard_runtime")
    shard_module(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)))  # dense: as ever
