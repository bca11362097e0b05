"""Scenarios for checkpointing the runtime cannot see (issue 14, item 2), run inside a gloo world (world.py).

A unit member recomputes (part of) its forward in backward through ``torch.utils.checkpoint`` *inside* the
unit's hooks: HF transformers' ``gradient_checkpointing_enable()`` (which checkpoints each decoder layer's
``forward``, not its ``__call__``, so no module hook fires in the recomputation), or a
``torch.utils.checkpoint.checkpoint(fn, x)`` call in a member's own ``forward``. The recomputation reads the
unit's parameters in backward although autograd saved none of them in forward.

Each case trains a sharded deepcopy against the same model in ONE process over the whole global batch
(equal per-rank chunks and a loss that is a mean over equally many items per rank, so the average of the
per-rank means is the global mean), and compares every parameter after training.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Optional

import torch
import torch.utils.checkpoint
from torch import nn

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module


def _assert_matches(runtime, reference: nn.Module, label: str) -> None:
    full = full_state_dict(runtime, rank0_only=False)
    expected = reference.state_dict()
    assert set(full) == set(expected), f"[{label}] keys differ: {sorted(set(full) ^ set(expected))}"
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"[{label}] {n}: {m}")


def _train_both(reference: nn.Module, sharded: nn.Module, batches: list, loss_fn, rank: int, world: int,
                lr: float, adam: bool = True) -> None:
    """The reference on each whole global batch in one process; the sharded model on this rank's chunk.

    ``adam=False``: SGD, for models with gradients that are zero in exact arithmetic (attention's key bias),
    whose rounding noise Adam's normalisation would blow up to steps of size ``lr``."""
    for model, local in ((reference, False), (sharded, True)):
        opt = (torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1) if adam
               else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
        for batch in batches:
            if local:
                batch = tuple(t.chunk(world)[rank] for t in batch)
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


# -- 1. HF Llama with gradient_checkpointing_enable() ------------------------------------------------------
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, attn_implementation="eager")
    return LlamaForCausalLM(config)


def _llama_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def llama_checkpointed(rank: int, world: int, cases: list[tuple[Optional[dict], bool]],
                       steps: int = 3) -> list[dict[str, Any]]:
    """``cases``: (``gradient_checkpointing_kwargs`` or None for HF's default, ``elide_backward_gathers``).
    Raises on the first case that does not match; returns per case the backward gathers elision skipped."""
    g = torch.Generator().manual_seed(11)
    batches = [(torch.randint(0, 128, (2 * world, 16), generator=g),) for _ in range(steps)]
    outcomes = []
    for kwargs, elide in cases:
        label = f"llama, gradient_checkpointing_kwargs={kwargs}, elide={elide}"
        torch.manual_seed(0)
        reference = tiny_llama()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable is a deprecated alias
            reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        reference.train()
        assert all(layer.gradient_checkpointing for layer in reference.model.layers)
        sharded = copy.deepcopy(reference)
        runtime = shard_module(sharded, sharding="full", units=["LlamaDecoderLayer"], elide_backward_gathers=elide)
        assert [u.name for u in runtime.units] == ["model.layers.0", "model.layers.1", "<root>"], runtime.units
        outcomes.append(_run_case(reference, sharded, runtime, batches, _llama_loss, rank, world, 1e-3, label))
    return outcomes


def _run_case(reference, sharded, runtime, batches, loss_fn, rank, world, lr, label, adam=True) -> dict[str, Any]:
    _train_both(reference, sharded, batches, loss_fn, rank, world, lr, adam)
    _assert_matches(runtime, reference, label)
    return {"case": label, "skipped_gathers": runtime.stats.skipped_gathers}


# -- 2. A plain torch model with torch.utils.checkpoint inside a unit member ------------------------------
class InnerCheckpointBlock(nn.Module):
    """A residual block whose body runs under ``torch.utils.checkpoint`` in its own forward.

    ``whole=True``: every parameter of the block is read inside the checkpointed region only (autograd saves
    none of them in forward). ``whole=False``: a LayerNorm runs outside the region (its weight is saved)."""

    def __init__(self, reentrant: bool, whole: bool, width: int = 16) -> None:
        super().__init__()
        self.reentrant, self.whole = reentrant, whole
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def _body(self, h: torch.Tensor) -> torch.Tensor:
        if self.whole:
            h = self.norm(h)
        return self.fc2(torch.tanh(self.fc1(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.whole else self.norm(x)
        return x + torch.utils.checkpoint.checkpoint(self._body, h, use_reentrant=self.reentrant)


class InnerCheckpointNet(nn.Module):
    """An embedding unit (fed token ids: its backward needs no weight, a gather elision may skip), then three
    checkpointing blocks, each a unit."""

    def __init__(self, reentrant: bool, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Embedding(32, width)
        self.blocks = nn.ModuleList([InnerCheckpointBlock(reentrant, whole=True, width=width),
                                     InnerCheckpointBlock(reentrant, whole=False, width=width),
                                     InnerCheckpointBlock(reentrant, whole=True, width=width)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _mse_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def torch_checkpointed(rank: int, world: int, cases: list[tuple[bool, bool]], steps: int = 3) -> list[dict[str, Any]]:
    """``cases``: (``use_reentrant``, ``elide_backward_gathers``). As ``llama_checkpointed``."""
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 32, (2 * world, 5), generator=g), torch.randn(2 * world, 5, 1, generator=g))
               for _ in range(steps)]
    outcomes = []
    for reentrant, elide in cases:
        label = f"torch.utils.checkpoint, use_reentrant={reentrant}, elide={elide}"
        torch.manual_seed(0)
        reference = InnerCheckpointNet(reentrant)
        sharded = copy.deepcopy(reference)
        runtime = shard_module(sharded, sharding="full", units=["Embedding", "InnerCheckpointBlock"],
                               elide_backward_gathers=elide)
        assert [u.name for u in runtime.units] == ["stem", "blocks.0", "blocks.1", "blocks.2", "<root>"], runtime.units
        outcomes.append(_run_case(reference, sharded, runtime, batches, _mse_loss, rank, world, 1e-2, label))
    return outcomes


# -- 3. The runtime's own activation checkpointing on HF models called as usual (their key/value cache on) ------
def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    return T5ForConditionalGeneration(config)


def _padded_llama_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    (ids,) = batch
    mask = torch.ones_like(ids)
    mask[:, -3:] = 0  # right padding, as a fine-tuning batch has: the mask must match the keys' length
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss  # use_cache left at the config's True


def _t5_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids.flip(1)).loss


def cached_layers_checkpointed(rank: int, world: int, cases: list[str], steps: int = 3) -> list[dict[str, Any]]:
    """``activation_checkpointing=True`` on HF Llama (padded mask) and T5, called with their cache on: the layers'
    recomputation must not write the cache a second time. One process without checkpointing is the reference. Then
    a cache that holds keys already, refused."""
    g = torch.Generator().manual_seed(12)
    batches = [(torch.randint(1, 128, (2 * world, 12), generator=g),) for _ in range(steps)]
    outcomes = []
    for name in cases:
        build, loss_fn, units = {"llama": (tiny_llama, _padded_llama_loss, ["LlamaDecoderLayer"]),
                                 "t5": (tiny_t5, _t5_loss, ["T5Block"])}[name]
        torch.manual_seed(0)
        reference = build()
        sharded = copy.deepcopy(reference)
        runtime = shard_module(sharded, sharding="full", units=units, activation_checkpointing=True)
        # SGD: padded positions leave gradients near zero, whose rounding Adam's normalisation would blow up
        outcomes.append(_run_case(reference, sharded, runtime, batches, loss_fn, rank, world, 1e-2, name, adam=False))
    from transformers import DynamicCache

    model = tiny_llama()
    shard_module(model, sharding="full", units=["LlamaDecoderLayer"], activation_checkpointing=True)
    with torch.no_grad():  # (with gradients the layers run without the cache: it would stay empty)
        past = model(input_ids=batches[0][0][:, :4], use_cache=True).past_key_values  # a prefix's keys
    try:
        model(input_ids=batches[0][0][:, 4:], past_key_values=past, labels=batches[0][0][:, 4:]).loss.backward()
    except RuntimeError as err:
        outcomes.append({"case": "a cache holding keys", "error": str(err)})
    assert isinstance(past, DynamicCache)
    return outcomes


def run_cases(rank: int, world: int, which: str, cases: list[Any]) -> list[dict[str, Any]]:
    return {"llama": llama_checkpointed, "torch": torch_checkpointed, "cached": cached_layers_checkpointed}[which](
        rank, world, cases)
