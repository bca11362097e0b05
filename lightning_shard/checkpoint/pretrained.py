"""``load_pretrained``: a weights file into a module, sharded or not (each rank reads only its slices, see
``weights.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Union

from torch import nn

from lightning_shard.checkpoint.files import CheckpointError
from lightning_shard.checkpoint.weights import load_into, open_weights


def load_pretrained(module: nn.Module, path: Union[str, Path], strict: bool = True,
                    prefix: str = "") -> tuple[list[str], list[str]]:
    """Load a weights file into ``module``, sharded (by ``ShardStrategy`` or ``shard_module``) or not.

    ``prefix`` places the file's names inside the module (e.g. ``"model."`` for a LightningModule holding
    the network as ``self.model``). With Lightning, call it in ``on_fit_start``: the model is sharded by
    then, and a checkpoint given to ``fit(ckpt_path=...)`` is restored after it.
    """
    runtime = getattr(module, "_shard_runtime", None)
    with open_weights(path) as source:
        if runtime is not None:
            return load_into(runtime, source, strict=strict, prefix=prefix)
        if any(p.is_meta for p in module.parameters()):
            raise CheckpointError("load_pretrained: the module is still on the meta device; load after the strategy"
                                  " has sharded it (e.g. in `on_fit_start`).")
        state = {prefix + n: source.whole(n) for n in source.names()}
        result = module.load_state_dict(state, strict=strict)
        return list(result.missing_keys), list(result.unexpected_keys)
