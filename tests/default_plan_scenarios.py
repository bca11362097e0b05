"""The default unit plan on real models (issue 19, item 1), run inside a gloo world (world.py).

With no ``units`` and no ``unit_size``, a model built from torch's own layers (Lightning's demo Transformer:
``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``) and an HF Llama (decoder layers holding
RMSNorms, a final RMSNorm outside them) are cut into one unit per layer plus the root, with no warning, and
train exactly like one process on the global batch; eval forwards under ``no_grad`` (torch's fused encoder
fast path included) match too.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch
from torch import nn

from lightning_shard.engine.shard_module import shard_module
from tests.hf_scenarios import _assert_matches, _train_both, tiny_llama


def _lightning_transformer() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=64, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.0)


def _transformer_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    ids, target = batch
    return nn.functional.nll_loss(model(ids, target), target.flatten())


def _transformer_eval(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(*batch)


def _llama_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[1], use_cache=False).loss


def _llama_eval(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(input_ids=batch[0], use_cache=False).logits


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable, Callable, int]] = {
    "lightning_transformer": (_lightning_transformer, _transformer_loss, _transformer_eval, 64),
    "hf_llama": (tiny_llama, _llama_loss, _llama_eval, 128),
}


def default_plans(rank: int, world: int, names: list[str], steps: int = 3) -> dict[str, Any]:
    """Per model: its default unit names and the warnings sharding it raised; raises on any mismatch."""
    results = {}
    for name in names:
        build, loss_fn, eval_fn, vocab = MODELS[name]
        g = torch.Generator().manual_seed(3)
        batches = [(torch.randint(0, vocab, (2 * world, 8), generator=g),
                    torch.randint(0, vocab, (2 * world, 8), generator=g)) for _ in range(steps)]
        torch.manual_seed(0)
        reference = build()
        sharded = copy.deepcopy(reference)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runtime = shard_module(sharded, sharding="full")
        _train_both(reference, sharded, batches, loss_fn, rank, world, lr=0.1, adam=False)
        _assert_matches(runtime, reference, name)
        reference.eval(), sharded.eval()
        with torch.no_grad():
            local = tuple(t.chunk(world)[rank] for t in batches[0])
            expected = eval_fn(reference, local)
            torch.testing.assert_close(eval_fn(sharded, local), expected, rtol=1e-5, atol=1e-6)
        results[name] = {"units": [u.name for u in runtime.units],
                         "warnings": [str(w.message) for w in caught if "lightning_shard" in str(w.message)]}
    return results


def _root_heavy_warnings() -> list[str]:
    """A model whose repeated pieces are plain ``nn.Linear`` (no block): everything stays in the root unit."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shard_module(model, sharding="full")
    return [str(w.message) for w in caught if "lightning_shard" in str(w.message)]


def run(rank: int, world: int) -> dict[str, Any]:
    return {**default_plans(rank, world, list(MODELS)), "root_heavy": _root_heavy_warnings()}
