"""What the commands check in a config before any rank starts: the options' values, in one line each (cli.py)."""

from __future__ import annotations

import logging
import os
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from lightning_shard.app import cli
from lightning_shard.lightning.precision import SUPPORTED_PRECISION


def local_world_size(trainer_cfg: DictConfig) -> int:
    """Processes to spawn on this machine; 1 when a cluster launcher (torchrun, SLURM) starts them."""
    if trainer_cfg.get("num_nodes", 1) != 1 or "LOCAL_RANK" in os.environ:
        return 1
    devices = trainer_cfg.get("devices", 1)
    if trainer_cfg.accelerator in ("gpu", "cuda") and devices == -1:
        return torch.cuda.device_count()
    return int(devices) if isinstance(devices, int) else 1


def check_options(cfg: DictConfig, prog: str, runs: bool = True) -> None:
    """Bad strategy, precision or Trainer values fail here, in one line with the option's own message, before any
    rank starts (or anything is estimated). ``runs``: the config will train (the Trainer is built once here, and the
    checkpoint to resume from looked at), not only be estimated."""
    with cli.bad_input(prog, InstantiationException):
        strategy = instantiate(cfg.strategy)
    devices, nodes = local_world_size(cfg.trainer), int(cfg.trainer.get("num_nodes", 1))
    if strategy.sharding == "hybrid" and strategy.shard_size and (devices * nodes) % strategy.shard_size:
        cli.fail(prog, f"strategy.shard_size={strategy.shard_size} must divide the world size {devices * nodes}"
                       f" (trainer.devices={devices} x trainer.num_nodes={nodes}).")
    if cfg.precision not in SUPPORTED_PRECISION:
        cli.fail(prog, f"`precision` must be one of {', '.join(SUPPORTED_PRECISION)}; got {cfg.precision!r}.")
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        cli.fail(prog, f"`trainer.accumulate_grad_batches` must be an int >= 1; got {accumulate!r}.")
    for key, kinds, allowed in _TRAINER_NUMBERS:
        value = cfg.trainer.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            cli.fail(prog, f"`trainer.{key}` must be {allowed}; got {value!r}.")
    if runs:
        _check_trainer(cfg, strategy, prog)
        _check_ckpt_path(cfg.get("ckpt_path"), prog)


# Trainer options whose wrong type Lightning reports without naming them ("'<' not supported between ...")
_TRAINER_NUMBERS = [
    *((key, int, "an integer") for key in ("max_steps", "min_steps", "max_epochs", "min_epochs", "num_nodes",
                                           "log_every_n_steps", "check_val_every_n_epoch", "num_sanity_val_steps")),
    *((key, (int, float), "a number") for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches",
                                                  "limit_predict_batches", "val_check_interval", "gradient_clip_val")),
]


def _check_trainer(cfg: DictConfig, strategy: Any, prog: str) -> None:
    """Lightning checks the Trainer's values as it is built: built once here (its startup lines kept for the ranks'),
    so that ``trainer.devices=0`` or ``trainer.max_steps=foo`` is one line, not a traceback from every rank."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    startup = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level, startup.level = startup.level, logging.WARNING
    try:
        with cli.bad_input(prog, InstantiationException, MisconfigurationException, ValueError, TypeError):
            instantiate(cfg.trainer, strategy=strategy, callbacks=[], logger=False)
    finally:
        startup.setLevel(level)


def _check_ckpt_path(ckpt_path: Optional[str], prog: str) -> None:
    """A checkpoint to resume from that is missing or not one: said before the ranks start and the data loads.
    Lightning's keywords (``last``, ``best``, ...) and remote paths are left to Lightning."""
    if ckpt_path is None or ckpt_path in ("last", "best", "hpc") or "://" in str(ckpt_path):
        return
    from lightning_shard.checkpoint import files

    try:
        resolved = files.resolve(Path(ckpt_path))
    except (FileNotFoundError, files.CheckpointError) as err:
        cli.fail(prog, f"`ckpt_path`: {err}")
    if resolved.is_file() and not zipfile.is_zipfile(resolved):
        cli.fail(prog, f"`ckpt_path`: {ckpt_path!r} is not a readable torch checkpoint (truncated or corrupted?).")
