"""The model state of a sharded checkpoint as Lightning's hooks see it: ``checkpoint["state_dict"]`` in
``on_load_checkpoint`` maps each name the checkpoint holds to a stand-in of its tensor, read only when the model
state is restored, each rank its own slices. As with a loaded state dict, a hook may rename keys (a refactored
module), drop them (a head trained anew) or put a whole tensor in a key's place, in place or in a new dict of the
stand-ins; a stand-in's values cannot be read there (saying so is this module's other job). Loading then takes the
stand-ins from the directory under their saved names and the whole tensors from memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, Optional

from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_shard.checkpoint import sharded
from lightning_shard.checkpoint.files import CheckpointError
from lightning_shard.checkpoint.full import load_full_state_dict
from lightning_shard.engine.runtime.hooks import ShardRuntime


class SavedTensor:
    """A tensor of a sharded checkpoint, not read yet: ``key`` is its name there; ``shape`` and ``dtype`` are known."""

    __slots__ = ("source", "key", "shape", "dtype")

    def __init__(self, source: "ShardedSource", key: str, metadata: Any) -> None:
        self.source, self.key = source, key
        tensor = isinstance(metadata, TensorStorageMetadata)
        self.shape = metadata.size if tensor else None
        self.dtype = metadata.properties.dtype if tensor else None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in SavedTensor.__slots__:  # copy, pickle and the like
            raise AttributeError(name)
        raise AttributeError(
            f"lightning_shard: {self.key!r} of the sharded checkpoint {str(self.source.directory)!r} is read after"
            " `on_load_checkpoint`, each rank its own slices, so `.{name}` cannot be used there. Keys of"
            " `checkpoint['state_dict']` can be renamed and dropped, and a value replaced by a whole tensor; to change"
            " values, consolidate it (`python -m lightning_shard.consolidate`) or save with state_dict_type='full'.")

    def __repr__(self) -> str:
        return f"SavedTensor({self.key!r}, shape={tuple(self.shape) if self.shape is not None else None})"


class ShardedSource(MutableMapping):
    """Stands in for a model state of a checkpoint opened from a directory; loading reads from it. ``prefix``:
    which of its model states (``state_dict``, or ``current_model_state`` where weights were averaged)."""

    def __init__(self, directory: Path, metadata: Metadata, prefix: str = sharded.MODEL_PREFIX) -> None:
        self.directory, self.metadata, self.prefix = directory, metadata, prefix
        self.entries: dict[str, Any] = {
            key[len(prefix):]: SavedTensor(self, key[len(prefix):], md)
            for key, md in metadata.state_dict_metadata.items() if key.startswith(prefix)}

    def __getitem__(self, key: str) -> Any:
        return self.entries[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, SavedTensor) and value.source is not self:
            raise ValueError(f"lightning_shard: {key!r} is given a tensor of another checkpoint"
                             f" ({value.source.directory}).")
        self.entries[key] = value

    def __delitem__(self, key: str) -> None:
        del self.entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"ShardedSource({str(self.directory)!r}, {len(self)} entries)"

    def split(self) -> tuple[dict[str, str], dict[str, Any]]:
        """The model's name -> the checkpoint's name of each stand-in, and the values given in their place."""
        names = {k: v.key for k, v in self.entries.items() if isinstance(v, SavedTensor)}
        return names, {k: v for k, v in self.entries.items() if not isinstance(v, SavedTensor)}


def sharded_source(state: Any) -> Optional[ShardedSource]:
    """The ShardedSource behind ``checkpoint["state_dict"]``: itself, or a new mapping of its stand-ins that
    ``on_load_checkpoint`` built; None for a state dict of tensors (a full checkpoint)."""
    if isinstance(state, ShardedSource):
        return state
    if not isinstance(state, Mapping):
        return None
    sources = {id(v.source): v.source for v in state.values() if isinstance(v, SavedTensor)}
    if not sources:
        return None
    if len(sources) > 1:
        raise ValueError("lightning_shard: `checkpoint['state_dict']` mixes tensors of several sharded checkpoints.")
    source = ShardedSource.__new__(ShardedSource)
    original = next(iter(sources.values()))
    source.directory, source.metadata, source.prefix = original.directory, original.metadata, original.prefix
    source.entries = dict(state)
    for key, value in source.entries.items():
        if not isinstance(value, (SavedTensor, Tensor)):
            raise TypeError(f"lightning_shard: `checkpoint['state_dict'][{key!r}]` is a {type(value).__name__}; give"
                            " it a tensor of the checkpoint (as read from it) or a whole tensor.")
    return source


def load_model_source(runtime: ShardRuntime, source: ShardedSource, strict: bool = True,
                      absent: AbstractSet[str] = frozenset()) -> None:
    """Load the model state as the hooks left it: each stand-in from the directory under its saved name, each whole
    tensor given in a stand-in's place from memory, each rank its own slices. ``absent``: as
    :func:`sharded.check_model_matches`'s."""
    names, given = source.split()
    unknown = sorted(set(given).difference(sharded.model_shapes(runtime)))
    if strict and unknown:
        raise CheckpointError(f"`on_load_checkpoint` put tensors under names the model does not have: {unknown[:8]}."
                              " (Pass strict=False / `strict_loading = False` to load the rest.)")
    sharded.load_model_state(runtime, source.directory, source.metadata, strict=strict, absent=set(absent) | set(given),
                             prefix=source.prefix, names=names)
    if given:
        load_full_state_dict(runtime, given, strict=False)
