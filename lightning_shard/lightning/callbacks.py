"""Callbacks for fine-tuning runs under ShardStrategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_shard.checkpoint.export import save_pretrained


class SavePretrained(Callback):
    """At the end of ``fit``, write the model as a Hugging Face folder that ``from_pretrained`` loads (a peft model:
    its adapter, unless ``merged=True``); ``options`` as ``save_pretrained``'s (``dtype``, ``max_shard_size``,
    ``merged``, ``prefix``, ``adapter``). Rank 0 writes; under ShardStrategy every rank gathers, one unit at a
    time."""

    def __init__(self, folder: Union[str, Path], **options: Any) -> None:
        self.folder, self.options = Path(folder), options

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        save_pretrained(pl_module, trainer.strategy.broadcast(str(self.folder)), **self.options)
