"""Lightning's built-in callbacks and tuner under ShardStrategy at 2 gloo ranks, each against Lightning's ``ddp`` in
the same world on the same data (fp32: 1e-5 relative, 1e-6 absolute): ``Tuner.lr_find`` and ``scale_batch_size``,
``GradientAccumulationScheduler``, ``EarlyStopping``, ``Timer``, the monitors, ``OnExceptionCheckpoint``, ``fit``
twice on one Trainer, fractional ``val_check_interval`` with step checkpoints, and an accumulation window that
``limit_train_batches`` cuts short. Run by test_callbacks_builtin.py, several scenarios per world."""

from __future__ import annotations

import csv
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import callbacks as cb
from lightning.pytorch.tuner import Tuner

from tests.callback_models import (
    MODEL, OPTIONS, BatchNet, FailingAt, FailingSetup, GroupedNet, LateClock, Net, RecordedSummary, ValLosses, ValNet,
    assert_as_ddp, both, listing,
    loader, run_named, same_losses, scenario, strategies,
)
from tests.lightning_port_models import assert_same, shard, state_of, trainer


@scenario
def lr_find(rank: int, world: int, root: Path) -> dict:
    """``Tuner.lr_find``: the sweep's losses and suggestion, the model restored after it (its checkpoint removed),
    then a fit at the suggested rate, as ddp's."""

    def run(strategy: Any, folder: Path) -> dict:
        model = Net(lr=0.01)
        t = trainer(strategy, folder, max_epochs=1)
        before = None
        finder = Tuner(t).lr_find(model, train_dataloaders=loader(1, 320), num_training=30, min_lr=1e-4, max_lr=1.0,
                                  early_stop_threshold=None, update_attr=True)
        after_find = state_of(t)
        left = listing(folder)
        model.losses.clear()
        t.fit(model, loader(1))
        return {"lr": finder.results["lr"], "loss": finder.results["loss"], "suggestion": finder.suggestion(),
                "hparam_lr": model.hparams.lr, "after_find": after_find, "left": left, "state": state_of(t),
                "losses": model.losses, "before": before}

    runs = both(rank, root, run)
    ours, ddp = runs["shard"], runs["ddp"]
    same_losses(ours["lr"], ddp["lr"], "lr_find lr")
    same_losses(ours["loss"], ddp["loss"], "lr_find loss")
    assert ours["suggestion"] == ddp["suggestion"] and ours["hparam_lr"] == ddp["hparam_lr"], (ours, ddp)
    assert_same(ours["after_find"], ddp["after_find"], "restored after lr_find")
    assert ours["left"] == ddp["left"] == [], (ours["left"], ddp["left"])
    same_losses(ours["losses"], ddp["losses"], "fit after lr_find")
    assert_same(ours["state"], ddp["state"], "fit after lr_find")
    return {"suggestion": ours["suggestion"]}


@scenario
def scale_batch_size(rank: int, world: int, root: Path) -> dict:
    """``Tuner.scale_batch_size`` and the ``BatchSizeFinder`` callback: Lightning refuses both for any distributed
    strategy (ddp included), with the same words under ShardStrategy."""
    said = {}
    for name, make in strategies().items():
        for how in ("tuner", "callback"):
            model = BatchNet()
            try:
                if how == "tuner":
                    Tuner(trainer(make(), root / name)).scale_batch_size(model, steps_per_trial=2, init_val=2)
                else:
                    finder = cb.BatchSizeFinder(steps_per_trial=2, init_val=2)
                    trainer(make(), root / name, callbacks=[finder]).fit(model)
            except Exception as e:  # noqa: BLE001 - the refusal compared
                said[f"{name} {how}"] = f"{type(e).__name__}: {e}"
    for how in ("tuner", "callback"):
        assert said.get(f"shard {how}") == said.get(f"ddp {how}") is not None, said
    return said


@scenario
def accumulation_scheduler(rank: int, world: int, root: Path) -> dict:
    """``GradientAccumulationScheduler({0: 1, 1: 3})`` over 3 epochs of 4 steps (the last window of each epoch cut
    short), with and without reduce_during_accumulation."""
    out = {}
    asked = OPTIONS.get("reduce_during_accumulation")
    for reduce in (True, False) if asked is None else (asked,):
        def run(strategy: Any, folder: Path) -> dict:
            model = Net()
            t = trainer(strategy, folder, max_epochs=3,
                        callbacks=[cb.GradientAccumulationScheduler({0: 1, 1: 3})])
            t.fit(model, loader(1))
            return {"losses": model.losses, "state": state_of(t), "steps": t.global_step}

        runs = both(rank, root / f"reduce{reduce}", run, reduce_during_accumulation=reduce)
        out[str(reduce)] = assert_as_ddp(runs, f"accumulation scheduler reduce={reduce}")["steps"]
    return out


@scenario
def limit_batches_partial_window(rank: int, world: int, root: Path) -> dict:
    """``limit_train_batches=3`` with ``accumulate_grad_batches=2``: Lightning steps on the last, one-batch window;
    also with gradient clipping by norm (on the window's gradients)."""
    out = {}
    for clip in (None, 0.05):
        def run(strategy: Any, folder: Path) -> dict:
            model = Net()
            t = trainer(strategy, folder, max_epochs=2, limit_train_batches=3, accumulate_grad_batches=2,
                        gradient_clip_val=clip)
            t.fit(model, loader(1))
            return {"losses": model.losses, "state": state_of(t), "steps": t.global_step}

        runs = both(rank, root / f"clip{clip}", run)
        out[f"clip={clip}"] = assert_as_ddp(runs, f"partial window, clip={clip}")["steps"]
    return out


@scenario
def early_stopping(rank: int, world: int, root: Path) -> dict:
    """``EarlyStopping`` on the train loss at the train epoch's end, and on the validation loss, stopping at the
    same epoch and step as ddp, with the callback's state."""
    out = {}
    for where in ("train", "val"):
        def run(strategy: Any, folder: Path) -> dict:
            model = ValNet(lr=0.5)
            stopper = (cb.EarlyStopping("train_loss", patience=1, min_delta=0.05, check_on_train_epoch_end=True)
                       if where == "train" else cb.EarlyStopping("val_loss", patience=0, min_delta=0.01))
            t = trainer(strategy, folder, max_epochs=8, callbacks=[stopper])
            t.fit(model, loader(1))
            return {"epoch": t.current_epoch, "steps": t.global_step, "stopped": stopper.stopped_epoch,
                    "wait": stopper.wait_count, "best": float(stopper.best_score), "state": state_of(t),
                    "losses": model.losses}

        runs = both(rank, root / where, run)
        out[where] = assert_as_ddp(runs, f"early stopping {where}", ("epoch", "steps", "stopped", "wait"))["stopped"]
    return out


@scenario
def timer_stop(rank: int, world: int, root: Path) -> dict:
    """``Timer(duration=...)`` (``max_time``): the ranks stop at one step, without a hang."""
    t = trainer(strategies()["shard"](), root, max_epochs=1000, max_time=timedelta(seconds=1.5),
                callbacks=[LateClock()])
    assert isinstance(t.callbacks[-1], cb.Timer)
    model = Net()
    started = time.monotonic()
    t.fit(model, loader(1))
    steps = torch.tensor([t.global_step])
    everyone = [torch.zeros_like(steps) for _ in range(world)]
    dist.all_gather(everyone, steps)
    assert len({int(s) for s in everyone}) == 1, everyone
    assert 0 < t.global_step < 4000 and t.current_epoch < 999, (t.global_step, t.current_epoch)  # stopped by time
    return {"steps": int(steps), "seconds": time.monotonic() - started}


@scenario
def fit_twice(rank: int, world: int, root: Path) -> dict:
    """``trainer.fit`` twice on one Trainer (max_epochs raised in between): the second fit goes on from the first."""

    def run(strategy: Any, folder: Path) -> dict:
        model = Net()
        t = trainer(strategy, folder, max_epochs=1)
        t.fit(model, loader(1))
        t.fit_loop.max_epochs = 2
        t.fit(model, loader(1))
        return {"losses": model.losses, "state": state_of(t), "steps": t.global_step}

    return {"steps": assert_as_ddp(both(rank, root, run), "fit twice")["steps"]}


@scenario
def val_interval_step_checkpoints(rank: int, world: int, root: Path) -> dict:
    """``val_check_interval=0.5`` with ``ModelCheckpoint(every_n_train_steps=3)`` and a ``val_loss`` top-2: the same
    files as ddp, and the best one's weights."""

    def run(strategy: Any, folder: Path) -> dict:
        model = ValNet()
        steps = cb.ModelCheckpoint(folder / "steps", every_n_train_steps=3, save_top_k=-1)
        best = cb.ModelCheckpoint(folder / "best", monitor="val_loss", save_top_k=2)
        t = trainer(strategy, folder, max_epochs=2, val_check_interval=0.5, enable_checkpointing=True,
                    callbacks=[steps, best])
        t.fit(model, loader(1))
        dist.barrier()
        return {"steps": sorted(p.name for p in (folder / "steps").iterdir()),
                "best": sorted(p.name for p in (folder / "best").iterdir()),
                "best_path": Path(best.best_model_path).name, "state": state_of(t), "losses": model.losses}

    runs = both(rank, root, run)
    ours, ddp = runs["shard"], runs["ddp"]
    assert ours["steps"] == ddp["steps"] and ours["best"] == ddp["best"], (ours["steps"], ddp["steps"], ours["best"],
                                                                           ddp["best"])
    assert ours["best_path"] == ddp["best_path"]
    same_losses(ours["losses"], ddp["losses"], "val_check_interval")
    assert_same(ours["state"], ddp["state"], "val_check_interval")
    return {"steps": ours["steps"], "best": ours["best"]}


@scenario
def lr_finder_callback(rank: int, world: int, root: Path) -> dict:
    """The ``LearningRateFinder`` callback: the sweep at the fit's start, the model restored, the fit continued at the
    suggested rate."""

    def run(strategy: Any, folder: Path) -> dict:
        model = Net(lr=0.01)
        finder = cb.LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=30, early_stop_threshold=None)
        t = trainer(strategy, folder, max_epochs=2, callbacks=[finder])
        t.fit(model, loader(1, 320))
        return {"suggestion": finder.optimal_lr.suggestion(), "lr": model.hparams.lr, "losses": model.losses,
                "state": state_of(t), "steps": t.global_step, "left": listing(folder),
                "optimizer_lr": t.optimizers[0].param_groups[0]["lr"]}

    runs = both(rank, root, run)
    ours, ddp = runs["shard"], runs["ddp"]
    assert (ours["suggestion"], ours["lr"], ours["steps"], ours["left"], ours["optimizer_lr"]) == \
        (ddp["suggestion"], ddp["lr"], ddp["steps"], ddp["left"], ddp["optimizer_lr"]), (ours, ddp)
    same_losses(ours["losses"], ddp["losses"], "LearningRateFinder")
    assert_same(ours["state"], ddp["state"], "LearningRateFinder")
    return {"suggestion": ours["suggestion"]}


@scenario
def callback_states_resumed(rank: int, world: int, root: Path) -> dict:
    """The states of ``EarlyStopping``, ``Timer`` and ``ModelCheckpoint`` saved in the checkpoint (sharded, and full)
    and restored by a resumed fit, as ddp's."""
    out = {}
    for form in ("sharded", "full"):
        def run(strategy: Any, folder: Path) -> dict:
            def callbacks():
                return [cb.EarlyStopping("val_loss", patience=5), cb.Timer(duration="00:01:00:00"),
                        cb.ModelCheckpoint(folder / "ckpt", monitor="val_loss", save_last=True, save_top_k=2)]
            model = ValNet()
            first = callbacks()
            t = trainer(strategy, folder, max_epochs=2, enable_checkpointing=True, callbacks=first)
            t.fit(model, loader(1))
            again = "ddp" if strategy == "ddp" else shard(**{**OPTIONS, "state_dict_type": form})
            second = callbacks()
            torch.manual_seed(1)
            model2 = ValNet()
            t2 = trainer(again, folder, max_epochs=3, enable_checkpointing=True, callbacks=second)
            t2.fit(model2, loader(1), ckpt_path="last")
            stop, timer, ckpt = second
            return {"wait": stop.wait_count, "best": float(stop.best_score),
                    "timer": timer.state_dict()["time_elapsed"]["train"] > 0,
                    "kth": sorted(Path(p).name for p in ckpt.best_k_models),
                    "best_path": Path(ckpt.best_model_path).name,
                    "losses": model2.losses, "state": state_of(t2)}

        runs = both(rank, root / form, run, state_dict_type=form)
        out[form] = assert_as_ddp(runs, f"resumed {form}", ("wait", "timer", "kth", "best_path"))["kth"]
    return out


@scenario
def validation_mid_window(rank: int, world: int, root: Path) -> dict:
    """Validation inside an accumulation window (``val_check_interval=3`` batches, ``accumulate_grad_batches=2``),
    and ``EarlyStopping`` on it stopping the fit there, between a window's micro-batches."""
    out = {}
    for stop in (False, True):
        def run(strategy: Any, folder: Path) -> dict:
            model = ValNet(lr=0.5)
            seen = ValLosses()
            # stopping_threshold: stops at the first validation, after batch 3 of a window of batches 3 and 4
            callbacks = [seen] + ([cb.EarlyStopping("val_loss", stopping_threshold=100.0)] if stop else [])
            t = trainer(strategy, folder, max_epochs=2, accumulate_grad_batches=2, val_check_interval=3,
                        callbacks=callbacks)
            t.fit(model, loader(1, 64))
            if stop:  # then fit on, from the half window's left-over gradients
                t.fit_loop.max_epochs = 3
                t.should_stop = False
                callbacks[1].stopping_threshold = None
                t.fit(model, loader(1, 64))
            return {"seen": seen.seen, "losses": model.losses, "state": state_of(t), "steps": t.global_step}

        runs = both(rank, root / f"stop{stop}", run)
        ours, ddp = runs["shard"], runs["ddp"]
        assert [s for s, _ in ours["seen"]] == [s for s, _ in ddp["seen"]], (ours["seen"], ddp["seen"])
        same_losses([v for _, v in ours["seen"]], [v for _, v in ddp["seen"]], f"val_loss stop={stop}")
        same_losses(ours["losses"], ddp["losses"], f"mid-window validation stop={stop}")
        assert_same(ours["state"], ddp["state"], f"mid-window validation stop={stop}")
        out[str(stop)] = ours["seen"]
    return out


@scenario
def fit_another_model(rank: int, world: int, root: Path) -> dict:
    """One Trainer fits a model, validates, then fits a second, fresh model: the second run is as a fresh ddp one."""

    def run(strategy: Any, folder: Path) -> dict:
        t = trainer(strategy, folder, max_epochs=1)
        t.fit(ValNet(), loader(1))
        t.validate(t.lightning_module, loader(2), verbose=False)
        torch.manual_seed(5)
        kind = MODEL["kind"]
        MODEL["kind"] = "gpt"  # from the boring net: another architecture, other parameter shapes
        try:
            second = ValNet(lr=0.05)
            t.fit_loop.max_epochs = 2
            t.fit(second, loader(3))
        finally:
            MODEL["kind"] = kind
        return {"losses": second.losses, "state": state_of(t), "steps": t.global_step}

    return {"steps": assert_as_ddp(both(rank, root, run), "second model")["steps"]}


@scenario
def exception_places(rank: int, world: int, root: Path) -> dict:
    """``OnExceptionCheckpoint`` (whose hook runs before the strategy's ``on_exception``) saving after a failure in
    validation, inside the forward, after backward, before the step (in an accumulation window); resumed, as ddp."""
    out = {}
    places = ("validation_step", "forward", "on_after_backward", "on_before_optimizer_step")
    for where, same_trainer in [(where, False) for where in places] + [(where, True) for where in places]:
        def run(strategy: Any, folder: Path) -> dict:
            t = trainer(strategy, folder, max_epochs=1, callbacks=[cb.OnExceptionCheckpoint(folder)],
                        enable_checkpointing=True, val_check_interval=2, accumulate_grad_batches=2)
            try:
                t.fit(FailingAt(where), loader(1, 64))
            except RuntimeError as e:
                assert "planted failure" in str(e), e
            else:
                raise AssertionError("no failure")
            if same_trainer:  # the failed fit's Trainer and model, fitted again from the checkpoint
                t2, model = t, t.lightning_module
                model.where = None
            else:
                torch.manual_seed(1)
                model = ValNet()
                again = "ddp" if strategy == "ddp" else shard(**OPTIONS)
                t2 = trainer(again, folder / "resumed", max_epochs=1, accumulate_grad_batches=2)
            model.losses.clear()
            t2.fit(model, loader(1, 64), ckpt_path=str(folder / "on_exception.ckpt"))
            return {"state": state_of(t2), "steps": t2.global_step, "losses": model.losses}

        runs = both(rank, root / f"{where}{'_again' if same_trainer else ''}", run)
        out[f"{where} again={same_trainer}"] = assert_as_ddp(runs, f"failure in {where}")["steps"]
    return out


@scenario
def monitors(rank: int, world: int, root: Path) -> dict:
    """``LearningRateMonitor(log_momentum=True, log_weight_decay=True)`` on two parameter groups,
    ``ThroughputMonitor`` and ``DeviceStatsMonitor``, with a CSV logger: ddp's columns, and its values of the
    learning rates, momenta, weight decays and losses."""
    from lightning.pytorch.loggers import CSVLogger

    def run(strategy: Any, folder: Path) -> dict:
        model = GroupedNet()
        t = trainer(strategy, folder, max_epochs=1, logger=CSVLogger(folder, name="", version=""),
                    log_every_n_steps=1,
                    callbacks=[cb.LearningRateMonitor("step", log_momentum=True, log_weight_decay=True),
                               cb.ThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0]), cb.DeviceStatsMonitor()])
        t.fit(model, loader(1))
        dist.barrier()
        with open(folder / "metrics.csv") as f:  # the strategy's own figures (shard/...) left out: ddp has none
            rows = [{k: v for k, v in r.items() if not k.startswith("shard/")} for r in csv.DictReader(f)]
        values = [{k: float(v) for k, v in r.items() if v and k.startswith(("lr-", "train_loss"))} for r in rows]
        return {"columns": sorted(rows[0]), "values": [v for v in values if v], "state": state_of(t),
                "losses": model.losses, "steps": t.global_step}

    runs = both(rank, root, run)
    ours, ddp = runs["shard"], runs["ddp"]
    assert ours["columns"] == ddp["columns"], set(ours["columns"]) ^ set(ddp["columns"])
    assert [sorted(r) for r in ours["values"]] == [sorted(r) for r in ddp["values"]], (ours["values"], ddp["values"])
    for a, b in zip(ours["values"], ddp["values"]):
        same_losses([a[k] for k in sorted(b)], [b[k] for k in sorted(b)], "logged values")
    assert_as_ddp(runs, "monitors")
    return {"columns": ours["columns"]}


@scenario
def model_summary(rank: int, world: int, root: Path) -> dict:
    """The model summary a fit prints (``max_depth=3``, an example input: its FLOPs too, with a frozen layer): rows,
    totals, size and FLOPs as ddp's, from full shapes."""

    def run(strategy: Any, folder: Path) -> dict:
        model = Net()
        first = next(iter(loader(1)))[0]
        model.example_input_array = first[:, :-1] if MODEL["kind"] == "gpt" else first  # (its tokens, but the last)
        next(iter(model.layer.children())).requires_grad_(False)
        summary = RecordedSummary(max_depth=3)
        t = trainer(strategy, folder, max_steps=1, enable_model_summary=True, callbacks=[summary])
        t.fit(model, loader(1))
        return {"seen": summary.seen}

    runs = both(rank, root, run)
    if rank == 0:
        assert runs["shard"]["seen"] == runs["ddp"]["seen"], (runs["shard"]["seen"], runs["ddp"]["seen"])
    return {"seen": runs["shard"]["seen"]}


@scenario
def exception_before_sharding(rank: int, world: int, root: Path) -> dict:
    """``OnExceptionCheckpoint`` after a failure before the model is sharded: in the module's ``setup`` hook, in a
    second fit's ``setup`` (the Trainer's runtime still the first model's), ShardStrategy's own refusal of a bad
    ``units``, and its refusal of ``ModelPruning`` (now before sharding: it was masked by ModelPruning's
    ``on_save_checkpoint`` calling ``state_dict()`` on the shards). The user's error is raised (it was a bare ``AssertionError`` from the checkpoint's state dict), and the
    checkpoint written holds the whole model as it was, as ddp's (one file, rank 0's), and no optimizer state (a
    second fit's ddp checkpoint holds the first model's)."""
    out = {}
    for where in ("setup", "second fit", "units", "refused callback"):
        def run(strategy: Any, folder: Path) -> dict:
            refused = where in ("units", "refused callback") and strategy != "ddp"  # (ddp's counterpart: setup fails)
            make = (lambda: shard(**{**OPTIONS, "units": ["Conv2d"]})) if where == "units" and refused else \
                (lambda: strategy)
            pruning = [cb.ModelPruning("l1_unstructured", amount=0.5)] if where == "refused callback" and refused \
                else []
            t = trainer(make(), folder, max_epochs=1, callbacks=[cb.OnExceptionCheckpoint(folder), *pruning],
                        enable_checkpointing=True)
            if where == "second fit":
                t.fit(Net(), loader(1))
            model = FailingSetup(fine=refused)
            initial = {k: v.clone() for k, v in model.state_dict().items()}
            try:
                t.fit(model, loader(1))
            except Exception as e:  # noqa: BLE001 - what the user is told, compared
                said = f"{type(e).__name__}: {e}"
            else:
                raise AssertionError("no failure")
            dist.barrier()
            saved = torch.load(folder / "on_exception.ckpt", weights_only=False)
            assert_same(saved["state_dict"], initial, f"{where}: the checkpoint's weights", 0, 0)
            if refused:  # the model left whole: ddp fits it
                trainer("ddp", folder / "ddp", max_steps=1).fit(model, loader(1))
            return {"said": said, "left": listing(folder), "optimizers": len(saved["optimizer_states"])}

        runs = both(rank, root / where.replace(" ", "_"), run)
        ours, ddp = runs["shard"], runs["ddp"]
        if where == "units":
            assert ours["said"].startswith("ValueError: `units` entries ['Conv2d'] match no module"), ours["said"]
        elif where == "refused callback":
            assert ours["said"].startswith("ValueError: lightning_shard: ['ModelPruning'] prune"), ours["said"]
        else:
            assert ours["said"] == ddp["said"] == "RuntimeError: planted failure in setup", (ours["said"], ddp["said"])
        assert ours["left"] == ddp["left"] == ["on_exception.ckpt"], (ours["left"], ddp["left"])
        assert ours["optimizers"] == 0, ours["optimizers"]  # (ddp's second fit saved the first model's)
        out[where] = ours["said"]
    return out


def run_scenarios(rank: int, world: int, names: list[str], root: str) -> dict[str, Any]:
    """The world's function (its ranks import this module, which registers the scenarios)."""
    return run_named(rank, world, names, root)
