"""Unit planning and bad input: clear errors at construction, naming the option and allowed values."""


import pytest
import torch
from torch import nn

from lightning_shard import ShardStrategy, shard_module
from lightning_shard.engine.plan import plan_units
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


def test_unit_size_never_splits_a_torch_builtin():
    plans = plan_units(models.Block(14), unit_size=50)
    assert "attn.out_proj" not in [m for p in plans for m in p.members]


def test_every_parameter_is_owned_exactly_once():
    model = models.TinyGPT()
    for kwargs in ({}, {"unit_size": 300}, {"units": ["LayerNorm", "Block"]}):
        owned = [id(p) for plan in plan_units(model, **kwargs) for p, _ in plan.params]
        assert sorted(owned) == sorted({id(p) for p in model.parameters()})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sharding": "zero3"}, r"`sharding` must be one of 'full', 'grad_op', 'none'; got 'zero3'"),
        ({"unit_size": 0}, r"`unit_size` must be a positive int"),
        ({"unit_size": 2.5}, r"`unit_size` must be a positive int"),
        ({"unit_size": True}, r"`unit_size` must be a positive int"),
        ({"units": ["Block"], "unit_size": 100}, r"either `units` .* or `unit_size`"),
        ({"prefetch": -1}, r"`prefetch` must be an int >= 0"),
        ({"timeout": "soon"}, r"`timeout` must be a timedelta or a number of seconds"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardStrategy(**kwargs)


def test_units_of_wrong_type_fail_at_construction():
    with pytest.raises(TypeError, match="`units` entries must be nn.Module classes or class names"):
        ShardStrategy(units=[42])


def test_unit_matching_nothing_warns_naming_it():
    with pytest.warns(UserWarning, match="`units` entry 'Blok' matches no module of TinyGPT"):
        plan_units(models.TinyGPT(), units=["Blok", "Block"])


def test_unsupported_precision_is_refused_when_the_trainer_is_built():
    import lightning as L

    with pytest.raises(ValueError, match="supported: '32-true'"):
        L.Trainer(strategy=ShardStrategy(), accelerator="cpu", devices=1, precision="64-true")


def test_registered_names():
    import lightning as L

    for name, sharding in [("lightning_shard", "full"), ("lightning_shard_grad_op", "grad_op"),
                           ("lightning_shard_no_shard", "none")]:
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
