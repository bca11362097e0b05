"""What a save copies (HostStager.copied_bytes) against the setup's estimate (checkpoint_staging) and the memory held
(the reserve), per optimizer; a single-process fit too (devices=1). Then the memory after fit: the staging reserve
and the writing thread outlive fit (nothing calls AsyncSaver.close).

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/staging_figures.py
"""
import os
import tempfile
import threading

from repro import common
from tests.world import run_world


def scenario(rank, world, directory, optimizer):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_shard import ShardStrategy

    common.as_lightning_rank(rank, world)
    saves = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=1)
    t = common.trainer(world, ShardStrategy(units=["Block"], async_save=True), [saves], max_steps=2)
    t.fit(common.module_class(optimizer, "none")(), common.loader())
    background = t.strategy._background
    threads = sorted(th.name.split("_")[-1] for th in threading.enumerate() if "lightning_shard_checkpoint" in th.name)
    return {"estimate": t.strategy.memory_estimate.checkpoint_staging, "copied": background.stager.copied_bytes,
            "held after fit": background.held_bytes, "saver threads alive after fit": threads}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for world, optimizer in ((2, "adamw"), (2, "amsgrad"), (2, "sgd"), (2, "adagrad"), (1, "adamw")):
            r = run_world(scenario, world, os.path.join(tmp, f"{optimizer}{world}"), optimizer, timeout=200)[0]
            print(f"world {world} {optimizer}: {r}")
