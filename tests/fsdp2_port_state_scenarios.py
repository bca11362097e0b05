"""FSDP2's scenarios of parameters and their state (test_fully_shard_training.py's shared parameters and
registration, test_fully_shard_init.py's re-initialisation, test_fully_shard_state_dict.py's round trips), each
against one process on the same global batch."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.engine.shard_module import shard_module
from tests.fsdp2_port_common import MLP, adamw, assert_same, compare


class TiedModel(nn.Module):
    """test_train_shared_params_uneven_shard's model: an embedding tied with the output, its rows not divisible by
    the world size; ids made from the float batch."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok_embeddings = nn.Embedding(vocab, 16)
        self.mid = MLP(16)
        self.output = nn.Linear(16, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, x):
        ids = (x.abs() * 1000).long() % self.vocab
        logits = self.output(self.mid(self.tok_embeddings(ids)))
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), ids.reshape(-1))


def tied_uneven(rank: int, world: int, mode: str) -> None:
    """test_train_shared_params_uneven_shard / test_train_parity_with_shared_params: every row of the tied weight
    trained as one process trains it (its last rows in the padded end of the last rank's shard)."""
    def step(model, x, i, side):
        loss = model(x)
        loss.backward()
        return loss

    compare(rank, world, lambda: TiedModel(world * 4 + 1), step, f"tied_uneven/{mode}", steps=5, mode=mode,
            units=["MLP"])


def _model() -> nn.Module:
    return nn.Sequential(MLP(), MLP(), nn.Linear(8, 3))


def _train(model, opt, batches, rank, world, ranks_averaged=1):
    """``ranks_averaged``: one process on the global batch divides its loss by the world size (as DDP averages)."""
    for x in batches:
        (model(x.chunk(world)[rank]).sum() / ranks_averaged).backward()
        opt.step()
        opt.zero_grad()


def reinit_in_keep_gathered(rank: int, world: int, mode: str) -> None:
    """test_reset_sharded_param: modules re-initialised after sharding (reset_parameters, HF's _init_weights) with
    the same seed as one process: inside keep_gathered(modifier_rank=0) (rank 0's draws kept), the weights are one
    process's, and training on from them is too."""
    torch.manual_seed(0)
    reference = _model()
    sharded = copy.deepcopy(reference)
    runtime = shard_module(sharded, sharding=mode, units=["MLP"])
    for model in (reference, sharded):
        torch.manual_seed(5 + rank)  # (the ranks' generators differ: rank 0's draws are kept)
        if model is reference:
            torch.manual_seed(5)
        with runtime.keep_gathered(modifier_rank=0) if model is sharded else torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
    assert_same(runtime, reference, f"reinit/{mode}")
    batches = [torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    _train(reference, adamw(reference), batches, 0, 1, world)
    _train(sharded, adamw(sharded), batches, rank, world)
    assert_same(runtime, reference, f"reinit then trained/{mode}")


def reinit_shards_in_place(rank: int, world: int) -> None:
    """test_reset_sharded_param done on the shard parameters themselves (nn.init.normal_, as HF's _init_weights
    after sharding): each rank draws its shard from its own generator, where FSDP2 draws the full tensor's values."""
    torch.manual_seed(0)
    reference = _model()
    sharded = copy.deepcopy(reference)
    runtime = shard_module(sharded, units=["MLP"])
    for model in (reference, sharded):
        torch.manual_seed(5)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
    assert_same(runtime, reference, "reinit_shards_in_place")


def reset_parameters_on_shards(rank: int, world: int) -> str:
    """Linear.reset_parameters() on a sharded unit outside keep_gathered: kaiming_uniform_ cannot take a 1-D shard."""
    model = _model()
    shard_module(model, units=["MLP"])
    try:
        model[0].in_proj.reset_parameters()
    except (ValueError, RuntimeError) as err:
        return str(err)
    return "no error"


def registration_kept(rank: int, world: int, mode: str) -> None:
    """test_param_registration_after_forward / _after_backward: the module's parameters are the shard parameters the
    optimizer holds after a forward without gradients, after a backward and after a step. (Between a forward with
    gradients and its backward the units still gathered show their gathered parameters, as FSDP2 registers its
    unsharded ones while a group is not resharded.)"""
    model = _model()
    shard_module(model, sharding=mode, units=["MLP"])
    opt = adamw(model)
    before = [(n, id(p)) for n, p in model.named_parameters()]
    x = torch.randn(2, 8)
    with torch.no_grad():
        model(x)
    after_forward = [(n, id(p)) for n, p in model.named_parameters()]
    model(x).sum().backward()
    after_backward = [(n, id(p)) for n, p in model.named_parameters()]
    opt.step()
    after_step = [(n, id(p)) for n, p in model.named_parameters()]
    for label, seen in (("forward", after_forward), ("backward", after_backward), ("step", after_step)):
        assert seen == before, f"[{mode}] after {label}: {seen} != {before}"
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {i for _, i in before}


def local_state_dict_round_trip(rank: int, world: int, mode: str) -> None:
    """test_dp_state_dict_save_load: the sharded model's own state_dict() and its optimizer's, loaded into a fresh
    sharded model and optimizer at the same world size, train on exactly as the model they came from."""
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(2 * world, 8, generator=g) for _ in range(4)]
    torch.manual_seed(0)
    reference = _model()
    first = copy.deepcopy(reference)
    runtime = shard_module(first, sharding=mode, units=["MLP"])
    opt = adamw(first)
    _train(first, opt, batches[:2], rank, world)
    with runtime.plain_state_dict():  # (state_dict() alone is refused: it would be a rank's shards, silently)
        model_state = {k: v.clone() for k, v in first.state_dict().items()}
    opt_state = copy.deepcopy(opt.state_dict())
    torch.manual_seed(1)
    second = _model()  # other weights, overwritten by the load
    runtime2 = shard_module(second, sharding=mode, units=["MLP"])
    with runtime2.plain_state_dict():
        second.load_state_dict(model_state)
    opt2 = adamw(second)
    opt2.load_state_dict(opt_state)
    _train(first, opt, batches[2:], rank, world)
    _train(second, opt2, batches[2:], rank, world)
    ref_opt = adamw(reference)
    _train(reference, ref_opt, batches, 0, 1, world)
    assert_same(runtime, reference, f"state_dict/{mode}/source")
    assert_same(runtime2, reference, f"state_dict/{mode}/loaded")


def full_state_dict_into_sharded(rank: int, world: int) -> str:
    """A plain (unsharded) state_dict given to a sharded model's load_state_dict: loaded, or refused by name."""
    torch.manual_seed(0)
    reference = _model()
    model = _model()
    runtime = shard_module(model, units=["MLP"])
    try:
        model.load_state_dict(reference.state_dict())
    except (RuntimeError, ValueError) as err:
        return str(err)
    assert_same(runtime, reference, "full into sharded")
    return "loaded"
