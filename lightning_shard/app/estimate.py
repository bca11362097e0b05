"""``python -m lightning_shard.estimate [Hydra overrides]``: one rank's memory peak for a training config
(its model, one batch of its data, its strategy, precision and world size), before anything is allocated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from lightning_shard.memory.estimate import MemoryEstimate, estimate_memory

PROG = "python -m lightning_shard.estimate"


def estimate_config(cfg: Any) -> tuple[MemoryEstimate, int]:
    """The estimate for a composed training config (``conf/``): its model, one batch of its data, its strategy,
    precision and world size. Returns the estimate and the world size."""
    from hydra.utils import instantiate

    from lightning_shard.app.train import build_data_and_model
    from lightning_shard.engine.optim.optimizers import WHOLE_PARAMETER_OPTIMIZERS
    from lightning_shard.lightning.precision import ShardPrecision

    with torch.device("meta"):  # the model's parameters are never allocated
        data, module = build_data_and_model(cfg)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    strategy = instantiate(cfg.strategy)
    precision = str(cfg.precision)
    policy = strategy.mixed_precision or ShardPrecision(precision).policy
    devices = int(cfg.trainer.devices)
    if devices < 0:  # -1: every GPU of the node
        devices = max(torch.cuda.device_count(), 1)
    world = devices * int(cfg.trainer.get("num_nodes", 1))
    optimizer = getattr(torch.optim, str(cfg.get("optimizer", "AdamW")))
    estimate = estimate_memory(
        module, world, sharding=strategy.sharding, units=strategy.units, unit_size=strategy.unit_size,
        min_unit_size=strategy.min_unit_size, prefetch=strategy.prefetch, param_dtype=policy.param_dtype,
        cast_params=policy.cast_params,
        master_dtype=torch.bfloat16 if precision == "bf16-true" else None, optimizer=optimizer,
        step=lambda m, b: m.training_step(b, 0), batch=batch,
        activation_checkpointing=strategy.activation_checkpointing,
        device="cuda" if cfg.trainer.accelerator in ("gpu", "cuda") else "cpu",
        whole=optimizer in WHOLE_PARAMETER_OPTIMIZERS or optimizer in tuple(strategy.matrix_optimizers),
        step_group_numel=strategy.step_group_size,
        shard_size=(strategy.shard_size or devices) if strategy.sharding == "hybrid" else None,
        offload=strategy.offload, autocast=ShardPrecision(precision).autocast_dtype,
        accumulate_grad_batches=int(cfg.trainer.get("accumulate_grad_batches", 1)),
        reduce_during_accumulation=strategy.reduce_during_accumulation,
        zero_grad_before_backward=not strategy.free_grads_after_step,
        async_save=strategy.async_save,
    )
    return estimate, world


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m lightning_shard.estimate [Hydra overrides]``: per-rank peak for the training config."""
    import warnings

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from lightning_shard.app import cli
    from lightning_shard.app.checks import check_options
    from lightning_shard.app.train import CONF_DIR

    parser = cli.ArgumentParser(prog=PROG, description="One rank's memory peak for a training config (its model,"
                                " one batch of its data, its strategy, precision and world size), before anything"
                                " is allocated.")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="as for python -m lightning_shard.train (its --help lists the config groups),"
                             " e.g. strategy=grad_op trainer.devices=4 precision=bf16-mixed")
    overrides = parser.parse_args(argv).overrides
    with cli.bad_input(PROG, HydraException, OmegaConfBaseException), \
            initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    check_options(cfg, PROG, runs=False)
    with warnings.catch_warnings(record=True) as caught:  # self.log() without a Trainer, in the model's training_step
        warnings.simplefilter("always")
        estimate, world = estimate_config(cfg)
    print(f"lightning_shard memory estimate per rank ({world} ranks, {' '.join(overrides) or 'defaults'}):")
    print(estimate.table())
    for note in dict.fromkeys(str(w.message) for w in caught if str(w.message).startswith("lightning_shard:")):
        print(note)
