"""A write error found by the next step's agreement (saves every 3 steps; rank 1's first write fails, the step after
the save starts 0.5 s late) under each sharding: every rank raises at the same step, naming the checkpoint.

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/shardings_failure.py
"""
import os
import tempfile
import time

from repro import common
from tests.world import run_world

SHARDINGS = {"full": {}, "grad_op": {"sharding": "grad_op"}, "none": {"sharding": "none"},
             "hybrid1": {"sharding": "hybrid", "shard_size": 1}}


def scenario(rank, world, directory, name):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_shard import ShardStrategy

    common.as_lightning_rank(rank, world)
    common.fail_write(rank, on_rank=1, at=1)
    where = []

    class Pause(L.Callback):
        def on_train_batch_start(self, trainer, *a):
            if trainer.global_step == 3:
                time.sleep(0.5)

        def on_exception(self, trainer, *a):
            where.append(trainer.global_step)

    saves = ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=0, save_last=True)
    t = common.trainer(world, ShardStrategy(units=["Block"], async_save=True, timeout=20, **SHARDINGS[name]),
                       [saves, Pause()])
    try:
        t.fit(common.module_class()(), common.loader())
        return "fit returned"
    except Exception as err:  # noqa: BLE001
        return f"at step {where}: {type(err).__name__}: {str(err)[:150]}"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for name in SHARDINGS:
            try:
                print(name, run_world(scenario, 2, os.path.join(tmp, name), name, timeout=200, pg_timeout=20))
            except BaseException as err:  # noqa: BLE001
                print(name, "world failed:", str(err)[-600:])
