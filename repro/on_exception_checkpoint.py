"""Lightning's OnExceptionCheckpoint with async_save: every rank raises in training_step at step 4 while step 3's
save is still being written (writes slowed to 1 s). Expected: step 3's checkpoint complete, the on-exception
checkpoint written (synchronously, after waiting for step 3's), the user's error raised, no hang.

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/on_exception_checkpoint.py
"""
import os
import tempfile

import torch

from repro import common
from tests.world import run_world


def scenario(rank, world, directory):
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
    from lightning_shard import ShardStrategy
    from lightning_shard.checkpoint import files

    common.as_lightning_rank(rank, world)
    common.slow_writes(1.0)
    Module = common.module_class()

    class Failing(Module):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 3:
                raise RuntimeError("user error at step 4")
            return super().training_step(batch, batch_idx)

    callbacks = [ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=0, save_last=True),
                 OnExceptionCheckpoint(dirpath=directory)]
    t = common.trainer(world, ShardStrategy(units=["Block"], async_save=True, timeout=20), callbacks)
    try:
        t.fit(Failing(), common.loader())
        raised = None
    except BaseException as err:  # noqa: BLE001
        raised = f"{type(err).__name__}: {str(err)[:100]}"

    def state(name):
        path = os.path.join(directory, name)
        if not os.path.isfile(os.path.join(path, files.MANIFEST)):
            return "incomplete/absent"
        return torch.load(os.path.join(path, files.META), weights_only=False)["global_step"]
    return {"raised": raised, "last.ckpt step": state("last.ckpt"), "on_exception.ckpt step": state("on_exception.ckpt")}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(run_world(scenario, 2, tmp, timeout=200, pg_timeout=20))
