"""A save from a callback's `on_fit_end` (Lightning calls it after the strategy's teardown, while the Trainer still
says FITTING/RUNNING) goes to the background after the teardown that waits for saves: `trainer.fit` returns while
it is still being written (writes slowed to 1 s here), and nothing waits for it.

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/save_in_on_fit_end.py
"""
import os
import sys
import tempfile

from repro import common
from tests.world import run_world


def scenario(rank, world, directory):
    import lightning as L
    from lightning_shard import ShardStrategy

    common.as_lightning_rank(rank, world)
    common.slow_writes(1.0)
    path = os.path.join(directory, "at_fit_end.ckpt")

    class AtFitEnd(L.Callback):
        def on_fit_end(self, trainer, pl_module):
            trainer.save_checkpoint(path)

    t = common.trainer(world, ShardStrategy(units=["Block"], async_save=True), [AtFitEnd()], max_steps=2,
                       enable_checkpointing=False)
    t.fit(common.module_class()(), common.loader())
    return {"complete when fit returned": os.path.isfile(os.path.join(path, "manifest.json"))}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(scenario, 2, tmp, timeout=200)
    print(results)
    sys.exit(0 if all(r["complete when fit returned"] for r in results) else 1)
