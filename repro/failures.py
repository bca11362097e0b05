"""How fits with async_save end: a write failing at the last save, `should_stop`, a KeyboardInterrupt, an exception
on one rank while a write is in flight; then what the same processes can still do (validate, a second fit resumed
from "last").

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/failures.py [mode ...]
"""
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from repro import common
from tests.world import run_world


def _state(path):
    from lightning_shard.checkpoint import files
    path = Path(path)
    if not (path / files.MANIFEST).is_file():
        return "incomplete" if path.exists() or files.partial_path(path).exists() else "absent"
    meta = torch.load(path / files.META, weights_only=False)
    return f"complete, global_step {meta['global_step']}"


def scenario(rank, world, directory, mode):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_shard import ShardStrategy

    common.as_lightning_rank(rank, world)
    if mode == "fail_last":
        common.fail_write(rank, on_rank=1, at=6)
    else:
        common.slow_writes(1.0)

    class Ending(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3 and mode == "should_stop":
                trainer.should_stop = True
            if trainer.global_step == 3 and mode == "interrupt":
                raise KeyboardInterrupt

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 4 and mode == "one_rank" and rank == 0:
                raise RuntimeError("user code failed on rank 0")

    last = os.path.join(directory, "last.ckpt")
    saves = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=0, save_last=True)
    t = common.trainer(world, ShardStrategy(units=["Block"], async_save=True, timeout=20), [saves, Ending()])
    module = common.module_class()()
    began = time.monotonic()
    out = {}
    try:
        t.fit(module, common.loader())
        out["fit"] = "returned"
    except BaseException as err:  # noqa: BLE001 - what each rank saw
        out["fit"] = f"{type(err).__name__}: {str(err)[:300]}"
        out["notes"] = [n[:200] for n in getattr(err, "__notes__", [])]
    out["seconds"] = round(time.monotonic() - began, 1)
    out["last.ckpt when fit ended"] = _state(last)
    out["status"] = str(t.state.status)
    if mode in ("fail_last", "should_stop"):
        try:
            t.validate(module, common.loader(16), verbose=False)
            out["validate after"] = "ok"
        except BaseException as err:  # noqa: BLE001
            out["validate after"] = f"{type(err).__name__}: {str(err)[:200]}"
        t2 = common.trainer(world, ShardStrategy(units=["Block"], async_save=True, timeout=20),
                            [ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=0, save_last=True)],
                            max_steps=7)
        module2 = common.module_class()()
        try:
            t2.fit(module2, common.loader(), ckpt_path="last")
            out["second fit"] = f"ran {len(module2.losses)} steps to {t2.global_step}; last.ckpt {_state(last)}"
        except BaseException as err:  # noqa: BLE001
            out["second fit"] = "".join(traceback.format_exception_only(err))[-300:]
    return out


if __name__ == "__main__":
    for mode in sys.argv[1:] or ("fail_last", "should_stop", "interrupt", "one_rank"):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                results = run_world(scenario, 2, os.path.join(tmp, "ckpt"), mode, timeout=200, pg_timeout=20)
            except BaseException as err:  # noqa: BLE001
                results = f"world failed: {str(err)[-1500:]}"
        print(f"== {mode}")
        for r, res in enumerate(results if isinstance(results, list) else [results]):
            print(f"  rank {r}: {res}")
