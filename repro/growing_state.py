"""The state a save copies grows during fit: a save before the first optimizer step (no optimizer state yet), then
saves after it, then a fine-tuning callback unfreezing a block at epoch 1 (its optimizer state appears). Every
checkpoint equals the synchronous fit's bit for bit; the staging memory follows the layout; figures: what each save
copied against the estimate's checkpoint_staging and what is held.

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/growing_state.py [save_frozen]
"""
import os
import sys
import tempfile
from pathlib import Path

from repro import common
from tests.world import run_world


def scenario(rank, world, directory, async_save_, save_frozen):
    import lightning as L
    from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint
    from lightning_shard import ShardStrategy

    common.as_lightning_rank(rank, world)
    common.slow_writes(0.3)
    figures = []

    class Unfreeze(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.model.blocks[0])

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.model.blocks[0], optimizer, lr=1e-2)

    class Saves(L.Callback):
        def on_train_start(self, trainer, *a):
            trainer.save_checkpoint(os.path.join(directory, "at_start.ckpt"))

        def on_train_batch_end(self, trainer, *a):
            background = getattr(trainer.strategy, "_background", None)
            if background is not None:
                figures.append((trainer.global_step, background.stager.copied_bytes, background.held_bytes))

    saves = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1)
    strategy = ShardStrategy(units=["Block"], async_save=async_save_, save_frozen=save_frozen)
    t = common.trainer(world, strategy, [Unfreeze(), Saves(), saves], max_steps=-1, max_epochs=2)
    module = common.module_class("adamw", "none")()
    t.fit(module, common.loader(24))
    estimate = t.strategy.memory_estimate.checkpoint_staging
    return {"losses": module.losses, "figures": figures, "estimate": estimate}


def compare(rank, world, a, b):
    from lightning_shard.checkpoint.consolidate import consolidate
    from tests.test_checkpoint_async import same

    def consolidated(path):
        checkpoint = consolidate(path)
        return {k: (repr(v).replace(a, "DIR").replace(b, "DIR") if k == "callbacks" else v)
                for k, v in checkpoint.items()}

    names = sorted(p.name for p in Path(a).glob("*.ckpt"))
    names_b = sorted(p.name for p in Path(b).glob("*.ckpt"))
    return {"names equal": names == names_b, "count": len(names),
            "differ": [n for n in names if n in names_b and not same(consolidated(Path(a) / n),
                                                                      consolidated(Path(b) / n))]}


if __name__ == "__main__":
    save_frozen = "save_frozen" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        sync = run_world(scenario, 2, os.path.join(tmp, "sync"), False, save_frozen, timeout=300)[0]
        background = run_world(scenario, 2, os.path.join(tmp, "async"), True, save_frozen, timeout=300)[0]
        result = run_world(compare, 1, os.path.join(tmp, "sync"), os.path.join(tmp, "async"), timeout=200)[0]
    print("losses equal:", sync["losses"] == background["losses"], result)
    print("estimate:", background["estimate"], "(step, copied, held):", background["figures"])
    sys.exit(0 if sync["losses"] == background["losses"] and result["names equal"] and not result["differ"] else 1)
