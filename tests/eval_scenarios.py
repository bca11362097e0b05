"""Scenarios for test_keep_gathered.py, run inside a gloo world: evaluation and generation with units held."""

from __future__ import annotations

import copy

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_shard.engine.shard_module import shard_module
from tests import models
from tests.engine_scenarios import train


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding, one forward per token (no cache): the tokens and the last step's logits."""
    tokens = prompt
    for _ in range(new_tokens):
        logits = model(tokens)
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens, logits


def generate_different_lengths(rank: int, world: int) -> dict:
    """Train, generate a different number of tokens on each rank inside ``keep_gathered`` (no collective there, so
    nothing to hang on), then train on: every figure against one process / DDP with the same weights."""
    g = torch.Generator().manual_seed(7)
    batches = [models.TinyGPT.batch(g, 12) for _ in range(6)]
    torch.manual_seed(0)
    reference = models.TinyGPT()
    sharded = copy.deepcopy(reference)
    ddp = DDP(reference)
    runtime = shard_module(sharded, units=["Block"], prefetch=1)
    report: dict = {"units": len(runtime.units)}
    train(ddp, models.TinyGPT.loss, batches[:3], rank, world)
    train(sharded, models.TinyGPT.loss, batches[:3], rank, world, runtime=runtime)

    prompt = batches[0][rank * 2 : rank * 2 + 2, :3]
    new_tokens = 2 + 3 * rank  # rank 0: 2 tokens, rank 1: 5
    before = runtime.stats.collectives
    with runtime.keep_gathered():
        at_entry = runtime.stats.collectives
        tokens, logits = greedy(sharded, prompt, new_tokens)
        report["collectives_inside"] = runtime.stats.collectives - at_entry
        with torch.enable_grad():  # a training forward inside is refused, not silently run on held units
            try:
                sharded(prompt)
                report["grad_forward"] = None
            except RuntimeError as error:
                report["grad_forward"] = str(error)
    report["gathers_at_entry"] = at_entry - before
    expected_tokens, expected_logits = greedy(reference, prompt, new_tokens)
    report["tokens_equal"] = torch.equal(tokens, expected_tokens)
    report["logits_close"] = torch.allclose(logits, expected_logits, rtol=1e-5, atol=1e-6)
    report["freed"] = all(not unit.is_gathered and not unit.storage.is_allocated for unit in runtime.units
                          if not unit.storage.aliases_shard)

    # without holding, the same generation gathers every unit at every token (what keep_gathered saves)
    at_start = runtime.stats.all_gather_bytes
    greedy(sharded, batches[0][:2, :3], 2)
    report["regathered_bytes"] = runtime.stats.all_gather_bytes - at_start

    losses = train(sharded, models.TinyGPT.loss, batches[3:], rank, world, runtime=runtime)
    expected = train(ddp, models.TinyGPT.loss, batches[3:], rank, world)
    report["losses_after"] = (losses, expected)
    return report


class Holder(torch.nn.Module):
    """A model held by another module, as a LightningModule holds ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = models.TinyGPT()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)


def called_below_the_root(rank: int, world: int) -> dict:
    """The held model called directly (``holder.model(...)``, as a callback's ``self.model.generate``) instead of
    through the root, outside any step: training steps against DDP, one of them after a backward that raised half-way
    (caught), then greedy decoding against one process."""
    g = torch.Generator().manual_seed(7)
    batches = [models.TinyGPT.batch(g, 12) for _ in range(3)]
    torch.manual_seed(0)
    reference = models.TinyGPT()
    holder = Holder()
    holder.model.load_state_dict(reference.state_dict())
    ddp = DDP(reference)
    runtime = shard_module(holder, units=["Block"])
    optimizers = torch.optim.AdamW(holder.model.parameters(), lr=1e-2), torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    report: dict = {"losses": ([], [])}
    for step, batch in enumerate(batches):
        local = batch.chunk(world)[rank]
        if step == 1:  # dropped, and the next call recovers from it, as a call of the root does
            report["raised"] = _failed_backward(holder.model, local)
        for model, optimizer, losses in zip((holder.model, ddp), optimizers, report["losses"]):
            loss = models.TinyGPT.loss(model, local, step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    prompt = batches[0][rank * 2 : rank * 2 + 2, :3]
    tokens, logits = greedy(holder.model, prompt, 3)
    expected_tokens, expected_logits = greedy(reference, prompt, 3)
    report["tokens_equal"] = torch.equal(tokens, expected_tokens)
    report["logits_close"] = torch.allclose(logits, expected_logits, rtol=1e-5, atol=1e-6)
    report["freed"] = all(not unit.is_gathered for unit in runtime.units if not unit.storage.aliases_shard)
    return report


def _failed_backward(model: torch.nn.Module, batch: torch.Tensor) -> bool:
    """A backward that raises half-way (a caught error): its final callback never runs."""
    def fail(_grad):
        raise RuntimeError("a failure in backward")

    def fail_in_backward(_module, _args, out):
        out.register_hook(fail)

    hook = model.blocks[1].register_forward_hook(fail_in_backward)
    try:
        models.TinyGPT.loss(model, batch, 0).backward()
    except RuntimeError as error:
        return "a failure in backward" in str(error)
    finally:
        hook.remove()
    return False



def backward_inside_the_hold(rank: int, world: int) -> dict:
    """An RL-style step: the policy's loss computed, then generation with every unit held, and the loss's backward run
    inside the hold (its graph made before it). The backward reduces as usual and leaves the held units gathered for
    the generation that follows; the weights and the tokens are DDP's."""
    g = torch.Generator().manual_seed(7)
    batches = [models.TinyGPT.batch(g, 12) for _ in range(3)]
    torch.manual_seed(0)
    reference = models.TinyGPT()
    sharded = copy.deepcopy(reference)
    ddp = DDP(reference)
    runtime = shard_module(sharded, units=["Block"], prefetch=1)
    report: dict = {"tokens_equal": [], "weights": []}
    for model in (ddp, sharded):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step, batch in enumerate(batches):
            loss = models.TinyGPT.loss(model, batch.chunk(world)[rank], step)
            prompt = batch[rank * 2: rank * 2 + 2, :3]
            if model is ddp:
                loss.backward()
                tokens, _ = greedy(reference, prompt, 2 + rank)
                report.setdefault("expected", []).append(tokens)
            else:
                with runtime.keep_gathered():
                    loss.backward()
                    tokens, _ = greedy(sharded, prompt, 2 + rank)
                report["tokens_equal"].append(torch.equal(tokens, report["expected"][step]))
            opt.step()
            opt.zero_grad()
    with runtime.keep_gathered():
        report["max_diff"] = max((a - b).abs().max().item()
                                 for a, b in zip(sharded.parameters(), reference.parameters()))
    report["freed"] = all(not unit.is_gathered for unit in runtime.units)
    del report["expected"]
    return report
