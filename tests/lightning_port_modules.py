"""Ported scenarios: building the model (``configure_model``, ``init_module``, meta-device materialisation, ``setup``,
activation checkpointing), from test_fsdp.py, test_model_parallel*.py and test_ddp_integration.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from lightning_shard import ShardStrategy
from tests.lightning_port_models import (
    FEATURES, BoringNet, assert_same, loader, scenario, shard, state_of, trainer,
)


def _initial_state(holder: dict) -> Callable:
    def on_train_start(module: L.LightningModule) -> None:
        holder.update(state_of(module.trainer))
    return on_train_start


class ConfiguredNet(BoringNet):
    """test_fsdp.py ``test_configure_model`` and ``test_modules_without_parameters``: the layers built in
    ``configure_model`` (on the meta device under ShardStrategy), a torchmetrics metric (no parameters) updated in
    training and logged, the devices and dtypes each hook sees."""

    def __init__(self) -> None:
        super().__init__(build_in="configure_model")
        import torchmetrics

        self.metric = torchmetrics.classification.MulticlassAccuracy(num_classes=2, average="micro")
        self.seen: dict[str, Any] = {}
        self.initial: dict = {}

    def setup(self, stage):
        self.seen["setup"] = (self.metric.device.type, self.layer is None)

    def configure_model(self):
        if self.layer is None:  # not again for a model already built (a second fit)
            self.layer = self.build()
        self.seen["configure_model"] = (self.layer[0].weight.device.type, self.layer[0].weight.dtype)

    def on_fit_start(self):
        self.seen["on_fit_start"] = (self.layer[0].weight.device.type, self.layer[0].weight.dtype)

    def on_train_start(self):
        if isinstance(self.trainer.strategy, ShardStrategy):
            _initial_state(self.initial)(self)

    def training_step(self, batch, batch_idx):
        self.metric(self(batch[0]).argmax(-1), batch[1])
        self.log("train_acc", self.metric, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


@scenario
def configure_model_and_metrics(rank: int, world: int, root: Path) -> dict:
    model = ConfiguredNet()
    t = trainer(shard(), root / "shard", max_epochs=2)
    t.fit(model, loader(1))
    assert model.seen == {"setup": ("cpu", True), "configure_model": ("meta", torch.float32),
                          "on_fit_start": ("cpu", torch.float32)}, model.seen
    initial = {k: v for k, v in model.initial.items()}
    reference = ConfiguredNet()
    reference.configure_model()
    reference.load_state_dict(initial)
    t_ddp = trainer("ddp", root / "ddp", max_epochs=2)
    t_ddp.fit(reference, loader(1))
    assert reference.seen["configure_model"] == ("cpu", torch.float32)
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-6)
    assert_same(state_of(t), state_of(t_ddp), "configure_model")
    torch.testing.assert_close(t.callback_metrics["train_acc"], t_ddp.callback_metrics["train_acc"])
    return {"train_acc": float(t.callback_metrics["train_acc"])}


class InitNet(BoringNet):
    """test_fsdp.py / test_model_parallel_integration.py ``test_module_init_context``."""

    expected_dtype = torch.float32

    def on_train_start(self):
        weight = self.layer[0].weight
        assert weight.device.type == "cpu" and weight.dtype == self.expected_dtype, (weight.device, weight.dtype)
        optimizer = self.optimizers(use_pl_optimizer=False)
        assert optimizer.param_groups[0]["params"][0].device.type == "cpu"
        assert optimizer.param_groups[0]["params"][0].dtype == self.expected_dtype


@scenario
def module_init_context(rank: int, world: int, root: Path) -> dict:
    seen = {}
    for precision, dtype in (("32-true", torch.float32), ("bf16-true", torch.bfloat16)):
        for empty_init in (False, True):
            torch.manual_seed(0)
            t = trainer(shard(), root / f"{precision}-{empty_init}", precision=precision, max_steps=2,
                        barebones=True)
            with t.init_module(empty_init=empty_init):
                model = InitNet()
            model.expected_dtype = dtype
            seen[(precision, empty_init)] = (model.layer[0].weight.device.type, model.layer[0].weight.dtype)
            assert seen[(precision, empty_init)] == ("meta" if empty_init else "cpu", dtype), seen
            t.fit(model, loader(1))
            assert all(torch.isfinite(torch.tensor(model.losses))), model.losses
    return {"seen": seen}


class NoResetParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        return x @ self.weight


class MaterializedNet(BoringNet):
    """test_model_parallel.py ``test_meta_device_materialization``: the LightningModule's own ``reset_parameters``
    fills its buffer; a module with parameters and no ``reset_parameters`` cannot be initialised from the meta device."""

    def __init__(self, without_reset: bool) -> None:
        super().__init__()
        self.extra = nn.Sequential(NoResetParameters(), NoResetParameters()) if without_reset else None
        self.register_buffer("buffer", torch.rand(2))

    def reset_parameters(self):
        self.buffer.fill_(1.0)

    def configure_model(self):
        pass


@scenario
def meta_device_materialization(rank: int, world: int, root: Path) -> dict:
    out = {}
    for without_reset in (False, True):
        with torch.device("meta"):
            model = MaterializedNet(without_reset)
        units = ["Linear", "NoResetParameters"] if without_reset else ["Linear"]
        t = trainer(shard(units=units), root / str(without_reset), max_steps=1,
                    barebones=True)
        try:
            t.fit(model, loader(1))
        except Exception as err:  # noqa: BLE001
            out[without_reset] = f"{type(err).__name__}: {err}"
            continue
        assert torch.equal(model.buffer, torch.ones(2)), model.buffer
        assert all(not p.is_meta for p in model.parameters()) and all(not b.is_meta for b in model.buffers())
        out[without_reset] = "materialized"
    return out


class SetupNet(BoringNet):
    """test_ddp_integration.py ``test_ddp_torch_dist_is_available_in_setup``: the process group exists in
    ``setup``; a head built there, as a datamodule's number of classes is known (a common habit), is trained."""

    def __init__(self) -> None:
        super().__init__()
        self.stages: list[str] = []
        self.head: Optional[nn.Module] = None

    def setup(self, stage):
        assert dist.is_initialized() and dist.get_world_size() == 2
        self.stages.append(stage)
        if self.head is None:
            self.head = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(self.layer(x))


@scenario
def setup_hook(rank: int, world: int, root: Path) -> dict:
    runs = {}
    for name in ("ddp", "shard"):
        torch.manual_seed(0)
        model = SetupNet()
        torch.manual_seed(1)  # the head: the same numbers in both runs
        t = trainer("ddp" if name == "ddp" else shard(), root / name, max_epochs=2)
        t.fit(model, loader(1))
        t.validate(model, loader(2), verbose=False)
        runs[name] = (model.losses, state_of(t), model.stages)
    assert runs["shard"][2] == runs["ddp"][2] == ["fit", "validate"], runs["shard"][2]
    torch.testing.assert_close(torch.tensor(runs["shard"][0]), torch.tensor(runs["ddp"][0]), rtol=1e-5, atol=1e-6)
    assert_same(runs["shard"][1], runs["ddp"][1], "head built in setup")
    return {"keys": list(runs["shard"][1])}


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class CheckpointedNet(BoringNet):
    """test_fsdp.py ``test_activation_checkpointing`` and Fabric's ``test_manual_activation_checkpointing``: blocks
    recomputed in backward, by the strategy's option, by torch's ``checkpoint_wrapper`` applied in ``configure_model``
    (``manual``), or both."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.layer = nn.Sequential(Block(), Block(), nn.Linear(FEATURES, 2))
        self.manual = manual

    def configure_model(self):
        if self.manual and type(self.layer[0]) is Block:  # not again for a model already built
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
                checkpoint_wrapper,
            )

            apply_activation_checkpointing(self.layer, checkpoint_wrapper_fn=checkpoint_wrapper,
                                           check_fn=lambda m: isinstance(m, Block))


@scenario
def activation_checkpointing(rank: int, world: int, root: Path) -> dict:
    torch.manual_seed(0)
    reference = CheckpointedNet()
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    t = trainer("ddp", root / "ddp")
    t.fit(reference, loader(1))
    expected = state_of(t)
    out = {}
    for name, manual, option in (("strategy", False, ["Block"]), ("manual", True, False), ("both", True, ["Block"])):
        model = CheckpointedNet(manual)
        model.load_state_dict(initial)
        t = trainer(shard(units=["Block"], activation_checkpointing=option), root / name)
        try:
            t.fit(model, loader(1))
        except Exception as err:  # noqa: BLE001
            out[name] = f"{type(err).__name__}: {err}"
            continue
        torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-6)
        assert_same({k.replace("._checkpoint_wrapped_module", ""): v for k, v in state_of(t).items()}, expected, name)
        out[name] = "exact"
    return out
