"""The models, data and helpers of ``callback_scenarios.py``: the scenarios' registry and runner, the model (Lightning's
BoringModel net or TinyGPT) and the ShardStrategy options a run's names ask for, and the comparison with ddp (fp32:
1e-5 relative, 1e-6 absolute)."""

from __future__ import annotations

import ast
import logging
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch import callbacks as cb
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_port_models import BoringNet, assert_same, broadcast_path, dataset, shard
from tests.lightning_port_models import loader as boring_loader
from tests.models import TinyGPT
from tests.world import as_lightning_rank

SCENARIOS: dict[str, Callable[[int, int, Path], dict]] = {}


# the model of a run's scenarios: "boring" (Lightning's BoringModel net) or "gpt" (tests/models.py's TinyGPT, its
# embedding tied with its head, blocks as units); a scenario named "name@model='gpt'" runs with it
MODEL = {"kind": "boring"}


class Net(BoringNet):
    """BoringNet, or TinyGPT on token batches (its loss the next token's), as ``MODEL`` says."""

    def build(self) -> torch.nn.Module:  # type: ignore[override]
        return TinyGPT() if MODEL["kind"] == "gpt" else BoringNet.build()

    def loss(self, batch):
        if MODEL["kind"] == "gpt":
            return TinyGPT.loss(self.layer, batch[0], 0)
        return super().loss(batch)

    def between_units(self) -> torch.nn.Module:
        return self.layer.blocks[1] if MODEL["kind"] == "gpt" else self.layer[1]


def loader(seed: int = 1, n: int = 32) -> DataLoader:
    if MODEL["kind"] == "gpt":
        tokens = TinyGPT.batch(torch.Generator().manual_seed(seed), n)
        return DataLoader(TensorDataset(tokens, torch.zeros(n)), batch_size=4)
    return boring_loader(seed, n)


def scenario(fn: Callable[[int, int, Path], dict]) -> Callable[[int, int, Path], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn


# ShardStrategy's options for every scenario of a run: a scenario named "name@option=value,..." runs with them
OPTIONS: dict[str, Any] = {}


def strategies(**shard_options: Any) -> dict[str, Callable[[], Any]]:
    return {"ddp": lambda: "ddp", "shard": lambda: shard(**{**OPTIONS, **shard_options})}


def listing(root: Path) -> list[str]:
    """What a run left under its folder, relative; a checkpoint (a file, or our directory) is one entry."""
    found: list[str] = []

    def walk(folder: Path) -> None:
        for path in sorted(folder.iterdir()):
            if path.is_dir() and not path.name.endswith(".ckpt"):
                walk(path)
            else:
                found.append(str(path.relative_to(root)))

    if root.exists():
        walk(root)
    return found


def same_losses(ours: list[float], reference: list[float], what: str) -> None:
    assert len(ours) == len(reference), f"{what}: {len(ours)} losses, ddp {len(reference)}"
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what} losses: {m}")


def assert_as_ddp(runs: dict[str, dict], what: str, equal: tuple[str, ...] = ("steps",)) -> dict:
    """The ShardStrategy run's ``equal`` entries (its steps), per-step losses and final weights are the ddp run's;
    its result."""
    ours, ddp = runs["shard"], runs["ddp"]
    for key in equal:
        assert ours[key] == ddp[key], (what, key, ours[key], ddp[key])
    if "best" in ddp:  # a monitored value
        torch.testing.assert_close(ours["best"], ddp["best"], rtol=1e-5, atol=1e-6)
    same_losses(ours["losses"], ddp["losses"], what)
    assert_same(ours["state"], ddp["state"], what)
    return ours


def both(rank: int, root: Path, run: Callable[[Any, Path], dict], **shard_options: Any) -> dict[str, dict]:
    """``run(strategy, folder)`` under ddp, then ShardStrategy, on a fresh seed each."""
    runs = {}
    for name, make in strategies(**shard_options).items():
        torch.manual_seed(0)
        folder = broadcast_path(root / name)
        strategy = make()
        runs[name] = run(strategy, folder)
        for option, value in {**OPTIONS, **shard_options}.items() if name == "shard" else ():  # as asked
            assert getattr(strategy, option) == value, (option, getattr(strategy, option), value)
        dist.barrier()
    return runs


class BatchNet(Net):
    """Net whose loader's batch size is the tuned ``batch_size``."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr)
        self.batch_size = 2

    def train_dataloader(self):
        return DataLoader(dataset(1, 64), batch_size=self.batch_size)


class ValNet(Net):
    def val_dataloader(self):
        return loader(2)


class LateClock(cb.Callback):
    """Before the ``max_time`` Timer (added after the Trainer's callbacks) starts its clock, rank 1 sleeps: each rank
    alone would stop at another step."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank == 1:
            time.sleep(1.0)


class ValLosses(cb.Callback):
    """Each validation's ``val_loss`` and the global step it ran at."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.seen.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))


class FailingAt(ValNet):
    """Raises on every rank at global step 2, in the place named: ``validation_step``, inside the model's forward
    (between its units), ``on_after_backward``, or ``on_before_optimizer_step``."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.between_units().register_forward_hook(self.maybe_fail_in_forward)

    def fail(self, where: str) -> None:
        if where == self.where and self.global_step == 2:
            raise RuntimeError(f"planted failure in {where}")

    def maybe_fail_in_forward(self, *args: Any) -> None:
        if self.training:
            self.fail("forward")

    def validation_step(self, batch, batch_idx):
        self.fail("validation_step")
        return super().validation_step(batch, batch_idx)

    def on_after_backward(self):
        self.fail("on_after_backward")

    def on_before_optimizer_step(self, optimizer):
        self.fail("on_before_optimizer_step")


class FailingSetup(ValNet):
    """Raises in its ``setup`` hook (before ShardStrategy shards the model), unless ``fine``."""

    def __init__(self, fine: bool = False) -> None:
        super().__init__()
        self.fine = fine

    def setup(self, stage: str) -> None:
        if not self.fine:
            raise RuntimeError("planted failure in setup")


class GroupedNet(Net):
    """Two parameter groups (decayed weights, undecayed biases), SGD with momentum and a step scheduler."""

    def configure_optimizers(self):
        weights = [p for n, p in self.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        optimizer = torch.optim.SGD([{"params": weights, "weight_decay": 0.01}, {"params": biases, "lr": 0.02}],
                                    lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RecordedSummary(cb.ModelSummary):
    """Lightning's ModelSummary (or, with ``rich``, RichModelSummary's numbers) as rank 0 would print it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.seen: dict[str, Any] = {}

    def summarize(self, summary_data, total_parameters, trainable_parameters, model_size,  # type: ignore[override]
                  total_training_modes, total_flops, **options: Any) -> None:
        self.seen = {"rows": summary_data, "total": total_parameters, "trainable": trainable_parameters,
                     "size": model_size, "modes": total_training_modes, "flops": total_flops}


def run_named(rank: int, world: int, names: list[str], root: str) -> dict[str, Any]:
    """Each named scenario (registered by ``scenario``) in turn, in its own folder: its result, or the error it
    raised (as text). A name ``"scenario@option=value,..."`` runs it with those ShardStrategy options (``model`` among
    them picks the model)."""
    as_lightning_rank(rank, world)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    results: dict[str, Any] = {}
    for name in names:
        torch.manual_seed(0)
        started = time.perf_counter()
        base, _, options = name.partition("@")
        OPTIONS.clear()
        OPTIONS.update({k: ast.literal_eval(v) for k, v in (o.split("=") for o in options.split(",") if o)})
        MODEL["kind"] = OPTIONS.pop("model", "boring")
        if MODEL["kind"] == "gpt":
            OPTIONS.setdefault("units", ("Block",))
        try:
            results[name] = SCENARIOS[base](rank, world, Path(root) / name.replace("@", "_").replace("=", "-"))
        except Exception:  # noqa: BLE001 - reported per scenario
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - started, 1)
        dist.barrier()
    return results
