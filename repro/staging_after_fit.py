"""After fit, the staging memory (a copy of the rank's whole checkpoint state, pinned on CUDA) and the writing thread
stay held by the strategy: through trainer.test/validate/predict, until the Trainer is garbage collected.

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/staging_after_fit.py
"""
import gc
import os
import tempfile
import weakref

from repro import common
from tests.world import run_world


def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


def scenario(rank, world, directory):
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_shard import ShardStrategy
    from tests.models import TinyGPT

    common.as_lightning_rank(rank, world)
    Module = common.module_class("adamw", "none")

    class Big(Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT(d=512, n_blocks=4)  # ~12.6M parameters: ~75 MB of AdamW state per rank

    out = {"rss before": rss_mb()}
    t = common.trainer(world, ShardStrategy(units=["Block"], async_save=True),
                       [ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=1)], max_steps=2)
    module = Big()
    t.fit(module, common.loader())
    saver = weakref.ref(t.strategy._background)
    out["held after fit MB"] = t.strategy._background.held_bytes >> 20
    out["rss after fit"] = rss_mb()
    t.validate(module, common.loader(8), verbose=False)
    out["held during validate MB"] = t.strategy._background.held_bytes >> 20
    del t, module
    gc.collect()
    out["saver alive after del trainer + gc"] = saver() is not None
    out["rss after gc"] = rss_mb()
    return out


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(run_world(scenario, 2, tmp, timeout=300)[0])
