"""Estimated against measured peak memory: a real sharded step in a gloo world, every tensor counted."""

from __future__ import annotations

import torch

from lightning_shard.engine.shard_module import shard_module
from lightning_shard.memory.estimate import estimate_memory
from lightning_shard.memory.tracker import LiveBytes
from tests import models


def loss(model, batch):
    return models.TinyGPT.loss(model, batch, 0)


def estimated_and_measured(rank: int, world: int, sharding: str, options: dict, batch_size: int,
                           d: int = 64, seq: int = 32, steps: int = 3) -> dict:
    torch.manual_seed(0)
    model = models.TinyGPT(vocab=37, d=d, n_blocks=4, seq=seq)
    options = dict(options)
    for block in model.blocks[: options.pop("frozen_blocks", 0)]:  # a fine-tuning's frozen base: no optimizer state
        block.requires_grad_(False)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 37, (batch_size, seq + 1), generator=g) for _ in range(steps)]
    # the loop below clears gradients after the optimizer step
    estimate = estimate_memory(model, world, sharding, step=loss, batch=batches[0], zero_grad_before_backward=False,
                               **options)
    runtime = shard_module(model, sharding=sharding, **options)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    live = LiveBytes()
    for i, batch in enumerate(batches):
        if i == steps - 1:  # the optimizer state exists: measure a steady step
            live.__enter__()
            gathered = [u.storage.gathered for u in runtime.units]
            # offload: the staging copies and the shards kept on the device (on a CPU run, all one memory)
            gathered += [t for u in runtime.units for t in (getattr(u.storage, "_staging", None),
                                                            getattr(u.storage, "_on_device", None)) if t is not None]
            state = [v for s in opt.state.values() for v in s.values()]
            live.track([*model.parameters(), *model.buffers(), *gathered, *state, batch])
        loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        runtime.after_optimizer_step()
    live.__exit__(None, None, None)
    return {"estimate": estimate.as_dict(), "measured": live.peak}


def through_lightning(rank: int, world: int, precision: str, accumulate: int, free_grads: bool, batch_size: int = 2,
                      vocab: int = 37, blocks: int = 12, d: int = 64, seq: int = 16) -> dict:
    """The estimate against one steady optimizer step of a real Trainer (its automatic optimization clears gradients
    between forward and backward unless the strategy freed them after the step; micro-batches accumulate), every
    tensor counted from the step's first micro-batch to its last's end."""
    import lightning as L

    from lightning_shard import ShardStrategy
    from lightning_shard.lightning.precision import ShardPrecision

    from tests.world import as_lightning_rank

    as_lightning_rank(rank, world)  # the world's ranks are the Trainer's
    measured_step = 2

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = models.TinyGPT(vocab=vocab, d=d, n_blocks=blocks, seq=seq)

        def training_step(self, batch, batch_idx):
            return gpt_loss(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.live = LiveBytes()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == measured_step * accumulate:  # the optimizer state and last step's gradients exist
                runtime = trainer.strategy.runtime
                state = [v for opt in trainer.optimizers for s in opt.state.values() for v in s.values()]
                params = list(pl_module.parameters())
                self.live.__enter__()
                self.live.track([*params, *(p.grad for p in params), *pl_module.buffers(), *state, batch,
                                 *(u.storage.gathered for u in runtime.units)])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == (measured_step + 1) * accumulate - 1:
                self.live.__exit__(None, None, None)

    torch.manual_seed(0)
    module = Module()
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (batch_size, seq + 1), generator=g) for _ in range((measured_step + 2) * accumulate)]
    estimate = estimate_memory(module.model, world, "full", step=gpt_loss, batch=batches[0],
                               param_dtype=ShardPrecision(precision).policy.param_dtype,
                               cast_params=ShardPrecision(precision).policy.cast_params,
                               autocast=ShardPrecision(precision).autocast_dtype, accumulate_grad_batches=accumulate,
                               zero_grad_before_backward=not free_grads)
    measure = Measure()
    strategy = ShardStrategy(free_grads_after_step=free_grads)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision=precision, max_epochs=1,
                        accumulate_grad_batches=accumulate, callbacks=[measure], use_distributed_sampler=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return {"estimate": estimate.as_dict(), "measured": measure.live.peak, "freed": strategy.frees_grads_after_step}


def gpt_loss(model, batch):
    return models.TinyGPT.loss(model, batch, 0)
