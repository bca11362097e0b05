"""Training entry point: compose the Hydra config, then build data, model, strategy and Trainer, fit
and test, writing logs, checkpoints and summary.json into the job's Hydra output dir; a few lines at the end
say how it went and where these are.

    python -m lightning_shard.train strategy=grad_op strategy.unit_size=2000000 trainer.devices=2 precision=bf16-mixed
    python -m lightning_shard.train -m strategy.unit_size=200000,400000,800000

Note: the ranks of a job are spawned here, by the job itself, with the rendezvous in their environment.
Lightning's own launcher would re-run the command line for every rank, and under ``-m`` that re-runs the
whole sweep with stray output dirs (lightning-hydra-template#393); spawned ranks never see Hydra.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

import hydra
import torch
import torch.multiprocessing as mp
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_shard.app import cli, report
from lightning_shard.app.checks import check_options, local_world_size
from lightning_shard.app.quiet import quiet, tested_once

PROG = "python -m lightning_shard.train"

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")  # inside the package: found by any install


def build_data_and_model(cfg: DictConfig) -> tuple[Any, Any]:
    """Instantiate the data module, then the LightningModule (whose vocabulary may come from the data)."""
    data = instantiate(cfg.data)
    model_cfg = cfg.model
    if "model" in model_cfg and OmegaConf.is_missing(model_cfg.model, "vocab_size"):  # known once data is built
        model_cfg = OmegaConf.merge(model_cfg, {"model": {"vocab_size": data.vocab_size}})
    return data, instantiate(model_cfg)


def build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """Instantiate data, model and Trainer from a resolved config."""
    import lightning as L

    L.seed_everything(cfg.seed, workers=True)
    data, module = build_data_and_model(cfg)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy), callbacks=callbacks, logger=loggers or False)
    return data, module, trainer


def run(cfg: DictConfig) -> Optional[float]:
    data, module, trainer = build(cfg)
    trainer.fit(module, data, ckpt_path=cfg.get("ckpt_path"))
    if cfg.get("test"):
        with tested_once(trainer):  # Lightning's note that samples may repeat, where they did
            trainer.test(module, data, verbose=False)  # the final report shows the test metrics, once
    value = trainer.callback_metrics.get("val_loss")
    return float(value) if value is not None else None


def _rank_main(local_rank: int, world: int, port: int, resolved: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0",
                      LOCAL_RANK=str(local_rank), RANK=str(local_rank))
    quiet()  # a spawned process starts with fresh warning filters
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    run(OmegaConf.create(resolved))


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _job(cfg: DictConfig) -> Optional[float]:
    """One run, or one job of a ``-m`` sweep; returns its validation loss (what a Hydra sweeper minimises)."""
    with cli.bad_input(PROG, OmegaConfBaseException):
        resolved = OmegaConf.to_container(cfg, resolve=True)  # ranks have no Hydra context for ${hydra:...}
    check_options(cfg, PROG)
    output_dir = HydraConfig.get().runtime.output_dir
    world = local_world_size(cfg.trainer)
    if world > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank_main, args=(world, port, resolved), nprocs=world, start_method="spawn")
        value = report.read_summary(output_dir).get("final_val_loss")
    else:
        value = run(OmegaConf.create(resolved))
    if rank_zero_only.rank == 0:  # the parent of spawned ranks, or global rank 0 under torchrun / SLURM
        print(report.final_report(output_dir), flush=True)
    return value


def main() -> Optional[float]:
    """The command: Hydra's app, bad input in one line (exit status 2), third-party noise filtered."""
    quiet()
    return cli.run_hydra(PROG, _job)
