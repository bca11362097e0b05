"""A real full disk (a 560 KiB tmpfs at /tmp/tiny60: room for one checkpoint of the tiny GPT (372 KiB), not two): save_last
every step; the second write runs out of space in the background. Expected: every rank raises naming last.ckpt,
no hang; last.ckpt is the first save's and a fit resumes from it with ckpt_path="last" (after the disk is cleared of
the partial one).

    mkdir -p /tmp/tiny60 && mount -t tmpfs -o size=560k tmpfs /tmp/tiny60   # (root)
    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/full_disk.py /tmp/tiny60
"""
import os
import shutil
import sys
import time

import torch

from repro import common
from tests.world import run_world


def fit(rank, world, directory, resume):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_shard import ShardStrategy

    common.as_lightning_rank(rank, world)
    starts = []

    class Start(L.Callback):
        def on_train_start(self, trainer, *a):
            starts.append(trainer.global_step)

    saves = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=0, save_last=True)
    t = common.trainer(world, ShardStrategy(units=["Block"], async_save=True, timeout=20), [saves, Start()],
                       max_steps=3 if resume else 6)
    began = time.monotonic()
    try:
        t.fit(common.module_class()(), common.loader(), ckpt_path="last" if resume else None)
        raised = None
    except BaseException as err:  # noqa: BLE001
        raised = f"{type(err).__name__}: {str(err)[:260]}"
    return {"raised": raised, "started at": starts, "seconds": round(time.monotonic() - began, 1)}


if __name__ == "__main__":
    directory = os.path.join(sys.argv[1], "ckpt")
    shutil.rmtree(directory, ignore_errors=True)
    print("fit:", run_world(fit, 2, directory, False, timeout=200, pg_timeout=20))
    print("left:", common.listing(directory))
    last = os.path.join(directory, "last.ckpt")
    print("last.ckpt step:", torch.load(os.path.join(last, "meta.pt"), weights_only=False)["global_step"])
    shutil.rmtree(os.path.join(directory, "last.ckpt.partial"), ignore_errors=True)
    print("resumed:", run_world(fit, 2, directory, True, timeout=200, pg_timeout=20))
