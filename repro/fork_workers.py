"""DataLoader workers forked (num_workers=2, not persistent: each epoch and each validation forks anew) while a
background write is in flight (writes slowed to 0.5 s, a save every 2 steps and at each epoch's end): no hang, and
the checkpoints equal the synchronous fit's. Launched as a user would: Lightning starts rank 1 by re-running this
script (the ranks of tests/world.py are daemonic: no DataLoader workers there).

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r timeout 600 python repro/fork_workers.py OUT_DIR sync
    cd /work/wt-60r && PYTHONPATH=/work/wt-60r timeout 600 python repro/fork_workers.py OUT_DIR async
    (then compare: python repro/fork_workers.py OUT_DIR compare)
"""
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from repro import common


def fit(directory, async_save_):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_shard import ShardStrategy

    common.slow_writes(0.5)
    callbacks = [ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1),
                 ModelCheckpoint(dirpath=os.path.join(directory, "epochs"), save_on_train_epoch_end=True,
                                 save_top_k=-1, filename="{epoch}")]
    t = common.trainer(2, ShardStrategy(units=["Block"], async_save=async_save_), callbacks, max_steps=-1,
                       max_epochs=3, limit_val_batches=2)
    module = common.module_class("adamw", "step", val=True)()
    train = DataLoader(common.loader(24).dataset, batch_size=4, num_workers=2)
    val = DataLoader(common.loader(16).dataset, batch_size=4, num_workers=2)
    t.fit(module, train, val)
    if t.is_global_zero:
        torch.save(module.losses, os.path.join(directory, "losses.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def compare(a, b):
    from lightning_shard.checkpoint.consolidate import consolidate
    from tests.test_checkpoint_async import same

    def load(path):
        c = consolidate(path)
        return {k: (repr(v).replace(a, "D").replace(b, "D") if k == "callbacks" else v) for k, v in c.items()}
    names = sorted(str(p.relative_to(a)) for p in Path(a).rglob("*.ckpt"))
    names_b = sorted(str(p.relative_to(b)) for p in Path(b).rglob("*.ckpt"))
    losses = torch.load(os.path.join(a, "losses.pt")) == torch.load(os.path.join(b, "losses.pt"))
    differ = [n for n in names if n in names_b and not same(load(Path(a) / n), load(Path(b) / n))]
    print("losses equal:", losses, "names equal:", names == names_b, len(names), "differ:", differ)
    return losses and names == names_b and not differ


if __name__ == "__main__":
    out, what = sys.argv[1], sys.argv[2]
    if what == "compare":
        sys.exit(0 if compare(os.path.join(out, "sync"), os.path.join(out, "async")) else 1)
    fit(os.path.join(out, what), what == "async")
