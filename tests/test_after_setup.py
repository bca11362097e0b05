"""A sharded model used as a plain one after setup (issue 14, item 10): conversions, ``state_dict()``, and the
Trainers that come after ``fit`` give the plain model's numbers or stop at once, naming the cause."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module
from tests.world import one_rank_here, run_world

pytestmark = pytest.mark.timeout(300)


class Block(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(self.norm(x)))


class Net(nn.Module):
    """Two units and a root unit; the head is tied to the embedding-like input layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6, bias=False)
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(6, 5, bias=False)
        self.out.weight = nn.Parameter(self.inp.weight.detach().t().contiguous())  # not tied: odd shapes
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x))) * self.scale


def _pair(seed: int = 0, **options) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    plain = Net()
    model = copy.deepcopy(plain)
    shard_module(model, units=[Block], **options)  # no process group: one rank
    return plain, model


def _storage_intact(model: nn.Module) -> bool:
    """Every shard parameter in the tree still views its unit's flat storage."""
    runtime = model._shard_runtime
    for unit in runtime.units:
        base = unit.storage.shard.untyped_storage().data_ptr()
        for slot, shard in zip(unit.storage.slots, unit.storage.shard_params):
            for module, attr in slot.locations:
                param = module._parameters[attr]
                if param is not shard or param.untyped_storage().data_ptr() != base:
                    return False
    return True


# -- conversions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, cause", [
    (lambda m: m.half(), r"dtype torch\.float32 -> torch\.float16"),
    (lambda m: m.double(), r"dtype torch\.float32 -> torch\.float64"),
    (lambda m: m.bfloat16(), r"dtype torch\.float32 -> torch\.bfloat16"),
    (lambda m: m.to(torch.float64), r"dtype torch\.float32 -> torch\.float64"),
    (lambda m: m.to("meta"), r"device cpu -> meta"),
    (lambda m: m.to_empty(device="cpu"), r"new tensors \(as `\.to_empty\(\)` makes\)"),
    (lambda m: m.blocks[1].lin.half(), r"dtype torch\.float32 -> torch\.float16, parameter 'blocks\.1\.lin\."),
    (lambda m: m.blocks.double(), r"dtype torch\.float32 -> torch\.float64, parameter 'blocks\.0\."),
])
def test_a_conversion_after_sharding_is_refused_before_it_changes_anything(call, cause):
    _, model = _pair()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    with pytest.raises(RuntimeError, match=r"this model is sharded; converting it \(" + cause) as error:
        call(model)
    assert "`.half()`, `.float()`, `.double()`" in str(error.value) and "mixed_precision" in str(error.value)
    assert _storage_intact(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for name, value in model.named_buffers():  # the buffers were not converted either
        assert value.dtype == buffers[name].dtype and torch.equal(value, buffers[name])


def test_conversions_that_change_nothing_keep_working_and_training_stays_exact():
    plain, model = _pair()
    for call in (lambda m: m.to("cpu"), lambda m: m.cpu(), lambda m: m.float(), lambda m: m.to(torch.float32),
                 lambda m: m.blocks[0].to("cpu"), lambda m: m.share_memory()):
        assert call(model) is not None
    assert _storage_intact(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    for m, o in ((model, opt), (plain, ref_opt)):
        for _ in range(2):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value)


def test_half_precision_gathers_allow_the_same_calls():
    """With param_dtype=bf16 the gathered parameters are bf16 and the masters fp32: `.float()` is a no-op on
    the tree between steps, `.half()` is not."""
    _, model = _pair(param_dtype=torch.bfloat16)
    model.float().to("cpu")
    with pytest.raises(RuntimeError, match=r"float32 -> torch\.float16"):
        model.half()


# -- state_dict() -----------------------------------------------------------------------------------
def test_state_dict_on_one_rank_is_the_plain_models_and_the_tree_is_left_as_it_was():
    plain, model = _pair(param_dtype=torch.bfloat16)  # the full values are the fp32 masters, not the bf16 gathers
    calls = []
    model.blocks[0].register_state_dict_post_hook(lambda m, sd, prefix, meta: calls.append(sd[prefix + "lin.weight"].shape))
    before = {name: p for name, p in model.named_parameters()}
    state = model.state_dict()
    assert list(state) == list(plain.state_dict())
    for name, value in plain.state_dict().items():
        assert value.dtype == state[name].dtype
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
    assert calls == [torch.Size([6, 6])]  # hooks see the full tensors
    # a submodule's state dict, kept parameters, and the tree afterwards
    assert {k: v.shape for k, v in model.blocks[1].state_dict().items()} == \
        {k: v.shape for k, v in plain.blocks[1].state_dict().items()}
    assert isinstance(model.state_dict(keep_vars=True)["inp.weight"], nn.Parameter)
    assert {name: p for name, p in model.named_parameters()} == before and _storage_intact(model)
    # a state_dict() that raises midway leaves the tree as it was too
    handle = model.blocks[1].register_state_dict_post_hook(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model.state_dict()
    handle.remove()
    assert _storage_intact(model)
    # the raw tree, for the checkpoint code
    with model._shard_runtime.plain_state_dict():
        raw = model.state_dict()
    assert raw["blocks.0.lin.weight"].dim() == 1


def test_shard_module_again_goes_on_with_the_same_options_and_refuses_others():
    _, model = _pair(sharding="grad_op")
    runtime = model._shard_runtime
    assert shard_module(model, sharding="grad_op", units=["Block"]) is runtime  # a class and its name are one policy
    for options, named in [({"sharding": "full"}, "sharding='grad_op' then, sharding='full' now"),
                           ({"unit_size": 40}, "units=('Block',) then, units=None now"),
                           ({"param_dtype": torch.bfloat16}, "param_dtype=None then, param_dtype=torch.bfloat16 now"),
                           ({"prefetch": 2}, "prefetch=1 then, prefetch=2 now"),
                           ({"activation_checkpointing": True}, "activation_checkpointing=False then")]:
        options = {"sharding": "grad_op", "units": [Block], **options}
        if "unit_size" in options:
            options.pop("units")
        with pytest.raises(ValueError, match="this model is sharded already") as error:
            shard_module(model, **options)
        assert named in str(error.value)
    # remove_hooks undoes the wraps; the runtime cannot be taken up again
    runtime.remove_hooks()
    assert all("_apply" not in m.__dict__ and "state_dict" not in m.__dict__ for m in model.modules())
    with pytest.raises(RuntimeError, match=r"its hooks were removed"):
        shard_module(model, sharding="grad_op", units=[Block])


# -- two ranks --------------------------------------------------------------------------------------
def _two_ranks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    plain = Net()
    model = copy.deepcopy(plain)
    runtime = shard_module(model, units=[Block])
    out: dict = {}
    try:
        model.state_dict()
    except RuntimeError as error:
        out["error"] = str(error)
    with runtime.plain_state_dict():
        out["raw_dims"] = {v.dim() for k, v in model.state_dict().items() if "weight" in k}
    try:
        model.cpu().half()
    except RuntimeError as error:
        out["half"] = str(error)
    full = full_state_dict(runtime, rank0_only=False)  # every rank: the supported way
    out["full_matches"] = list(full) == list(plain.state_dict()) and all(
        torch.equal(full[k], v) for k, v in plain.state_dict().items())
    # sharding="none" keeps the whole model on every rank: its state_dict() needs no collective
    replicated = copy.deepcopy(plain)
    shard_module(replicated, sharding="none", units=[Block])
    state = replicated.state_dict()
    out["replicated_matches"] = all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    return out


def test_state_dict_over_two_ranks_is_refused_naming_what_to_call():
    for out in run_world(_two_ranks, 2, timeout=180):
        assert "full_state_dict(model._shard_runtime)" in out["error"] and "trainer.save_checkpoint" in out["error"]
        assert "would hang" in out["error"]
        assert out["raw_dims"] == {1}
        assert "float32 -> torch.float16" in out["half"]
        assert out["full_matches"] and out["replicated_matches"]


# -- Trainers after fit -----------------------------------------------------------------------------
def test_after_fit_state_dict_works_a_second_trainer_goes_on_and_others_are_refused():
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shard import ShardStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def trainer(strategy):
        return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)  # the batches in order, as in the plain loop below

    torch.manual_seed(0)
    lit = Lit()
    plain = copy.deepcopy(lit.net)
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    data = DataLoader(TensorDataset(x), batch_size=4)
    with one_rank_here():
        trainer(ShardStrategy(units=[Block])).fit(lit, data)
        assert lit.state_dict()["net.blocks.0.lin.weight"].shape == (6, 6)  # the full one, after fit
        trainer(ShardStrategy(units=[Block])).fit(lit, data)  # a second Trainer trains on
        with pytest.raises(ValueError, match=r"sharded already.*units=\('Block',\) then, units=None now"):
            trainer(ShardStrategy()).fit(lit, data)
        with pytest.raises(ValueError, match=r"param_dtype=None then, param_dtype=torch\.bfloat16 now"):
            trainer(ShardStrategy(units=[Block], mixed_precision=_bf16())).fit(lit, data)
        with pytest.raises(RuntimeError, match=r"a Trainer with SingleDeviceStrategy cannot run it"):
            trainer("auto").fit(lit, data)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(2):  # two fits of two steps: the same two batches twice
        for (batch,) in data:
            opt.zero_grad()
            plain(batch).square().mean().backward()
            opt.step()
    state = lit.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state["net." + name], value)
    lit.to("cpu")  # the user's own no-op after the refused Trainer


def _bf16():
    from lightning_shard.lightning.precision import MixedPrecision

    return MixedPrecision(param_dtype=torch.bfloat16)


def test_sync_batchnorm_converts_on_the_first_setup_even_a_validate_before_fit():
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shard import ShardStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))

        def validation_step(self, batch, batch_idx):
            self.net(batch[0])

    lit = Lit()
    data = DataLoader(TensorDataset(torch.randn(8, 5)), batch_size=4)
    trainer = L.Trainer(strategy=ShardStrategy(), accelerator="cpu", devices=1, sync_batchnorm=True,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with one_rank_here():
        trainer.validate(lit, data)
        # the model is sharded once, so converted then (SyncBatchNorm trains on GPUs only: no fit here)
        assert isinstance(lit.net[1], nn.SyncBatchNorm)
