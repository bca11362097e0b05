"""ModelCheckpoint's version counter (`filename` repeated: "-v1", "-v2") checks whether the path exists before saving.
Under async_save the previous save to that name may still be in flight (only NAME.partial exists): the counter does
not advance, and the next save overwrites the checkpoint a synchronous run keeps.

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/versioning.py
"""
import os
import sys
import tempfile

from repro import common
from tests.world import run_world


def scenario(rank, world, directory, async_save_):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_shard import ShardStrategy

    common.as_lightning_rank(rank, world)
    common.slow_writes(0.3)
    saves = ModelCheckpoint(dirpath=directory, filename="fixed", every_n_train_steps=1, save_top_k=-1,
                            monitor="train_loss")
    t = common.trainer(world, ShardStrategy(units=["Block"], async_save=async_save_), [saves], max_steps=4)
    t.fit(common.module_class()(), common.loader())
    return {"files": common.listing(directory), "best_k": sorted(os.path.basename(p) for p in saves.best_k_models)}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        sync = run_world(scenario, 2, os.path.join(tmp, "sync"), False, timeout=200)[0]
        background = run_world(scenario, 2, os.path.join(tmp, "async"), True, timeout=200)[0]
    print("sync :", sync)
    print("async:", background)
    sys.exit(0 if sync == background else 1)
