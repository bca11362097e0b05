"""Rank 0 (the one that commits, and hosts the process group's store) SIGKILLed in its second background write:
rank 1 must raise (not hang) within the timeout, naming the checkpoint; last.ckpt stays the first save's.

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/kill_rank0.py
"""
import os
import tempfile
import time

import torch

from repro import common
from tests.world import run_world


def scenario(rank, world, directory):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_shard import ShardStrategy

    common.as_lightning_rank(rank, world)
    common.fail_write(rank, on_rank=0, at=2, delay=0.2, kill=True)
    saves = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=0, save_last=True)
    t = common.trainer(world, ShardStrategy(units=["Block"], async_save=True, timeout=15), [saves])
    began = time.monotonic()
    try:
        t.fit(common.module_class()(), common.loader())
        out = "fit returned"
    except BaseException as err:  # noqa: BLE001
        out = f"{type(err).__name__}: {str(err)[:160]} | notes: {[n[:160] for n in getattr(err, '__notes__', [])]}"
    return {"after s": round(time.monotonic() - began, 1), "raised": out}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        began = time.monotonic()
        results = run_world(scenario, 2, tmp, timeout=240, pg_timeout=15, may_die=(0,))
        print("world ended after", round(time.monotonic() - began, 1), "s:", results)
        from lightning_shard.checkpoint import files
        last = os.path.join(tmp, "last.ckpt")
        complete = os.path.isfile(os.path.join(last, files.MANIFEST))
        print("last.ckpt complete:", complete, "global_step", torch.load(os.path.join(last, files.META),
                                                                        weights_only=False)["global_step"] if complete else None)
