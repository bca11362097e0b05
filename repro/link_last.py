"""ModelCheckpoint(save_last="link"): Lightning points last.ckpt at the checkpoint just saved, right after the save
returns. Under async_save that checkpoint is still being written: if its write fails (or a rank dies), last.ckpt is
left dangling (its previous target, the newest complete checkpoint, is no longer linked) and `ckpt_path="last"`
cannot resume, where a synchronous save leaves last.ckpt on the previous complete checkpoint.

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/link_last.py
"""
import os
import sys
import tempfile
import traceback

from repro import common
from tests.world import run_world


def failing_fit(rank, world, directory, async_save_):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_shard import ShardStrategy

    common.as_lightning_rank(rank, world)
    if async_save_:
        common.fail_write(rank, on_rank=1, at=3)
    else:  # the synchronous save's third write fails on rank 1 too
        from lightning_shard.checkpoint import sharded
        original, count = sharded.save, {"n": 0}

        def save(items, partial):
            count["n"] += 1
            if rank == 1 and count["n"] == 3:
                raise OSError(28, "No space left on device (injected)")
            return original(items, partial)
        sharded.save = save
        import lightning_shard.checkpoint.io as io
        io.sharded.save = save
    saves = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=1, monitor="step", mode="max",
                            save_last="link")
    t = common.trainer(world, ShardStrategy(units=["Block"], async_save=async_save_, timeout=30), [saves])
    try:
        t.fit(common.module_class()(), common.loader())
        error = None
    except Exception as err:  # noqa: BLE001
        error = f"{type(err).__name__}: {str(err)[:200]}"
    last = os.path.join(directory, "last.ckpt")
    return {"error": error, "files": common.listing(directory),
            "last ->": os.readlink(last) if os.path.islink(last) else None,
            "last target exists": os.path.exists(last)}


def resume_last(rank, world, directory):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_shard import ShardStrategy

    common.as_lightning_rank(rank, world)
    saves = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=1, monitor="step", mode="max",
                            save_last="link")
    t = common.trainer(world, ShardStrategy(units=["Block"], timeout=30), [saves], max_steps=7)
    starts = []

    import lightning as L

    class Start(L.Callback):
        def on_train_start(self, trainer, *a):
            starts.append(trainer.global_step)
    t.callbacks.append(Start())
    try:
        t.fit(common.module_class()(), common.loader(), ckpt_path="last")
        return {"resumed at step": starts[0]}
    except Exception as err:  # noqa: BLE001
        return {"resume error": "".join(traceback.format_exception_only(err))[-300:]}


if __name__ == "__main__":
    bad = False
    with tempfile.TemporaryDirectory() as tmp:
        for mode in (False, True):
            directory = os.path.join(tmp, "async" if mode else "sync")
            fit = run_world(failing_fit, 2, directory, mode, timeout=200)
            print("async" if mode else "sync ", "fit:", fit[0])
            resumed = run_world(resume_last, 2, directory, timeout=200)[0]
            print("async" if mode else "sync ", "resume last:", resumed)
            bad |= "resume error" in resumed
    sys.exit(1 if bad else 0)
