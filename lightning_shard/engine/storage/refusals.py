"""What a model may not bring to sharding, refused at setup before any collective (every rank raises the same),
each naming what it found and what to do instead."""

from __future__ import annotations

from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import prune

from lightning_shard.engine.plan.plan import UnitPlan
from lightning_shard.engine.storage.outside import TreeParameters


def refuse_sharded_parts(root: nn.Module) -> None:
    """A parameter is sharded once, by one runtime: sharding a model whose submodule was sharded (or that shares a
    submodule with another sharded model) would flatten that runtime's 1-D shards as if they were the parameters, and
    two runtimes would gather and step the same tensors (silently wrong, or a shape error)."""
    runtimes = [name for name, m in root.named_modules() if name and getattr(m, "_shard_runtime", None) is not None]
    if runtimes:
        raise ValueError(
            f"lightning_shard: submodules {runtimes[:4]} of this model are sharded already (by an earlier shard_module"
            " call): each parameter is sharded once, by one runtime. Shard the whole model once (its submodules"
            " become units: name their classes in `units=`), on a model none of whose parts was sharded.")
    held = [_fqn(name, attr) for name, m in root.named_modules()
            if isinstance(m.__dict__.get("_parameters"), TreeParameters) for attr in m._parameters]
    if held:
        raise ValueError(
            f"lightning_shard: parameters {held[:4]} are sharded already, by the runtime of another model this one"
            " shares modules with: each parameter is sharded once, by one runtime. Shard one model holding every"
            " part (a module with both as submodules), or give each model its own copy of the shared module.")


def refuse_lazy(root: nn.Module) -> None:
    """A lazy module (``nn.LazyLinear`` ...) has no shape until its first forward: nothing to flatten or shard."""
    lazy = [name or "<root>" for name, m in root.named_modules()
            if any(is_lazy(t) for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)]
    if lazy:
        raise ValueError(
            f"lightning_shard: {lazy[:4]} are lazy modules not initialised yet (`nn.LazyLinear` and the like get their"
            " shapes at their first forward), so their parameters have no shape to shard. Run one forward on a"
            " sample batch before sharding (with Lightning: in the LightningModule's `setup()`), or give the layers"
            " their input sizes (`nn.Linear(in_features, out_features)`).")


def refuse_pruned(root: nn.Module) -> None:
    """torch.nn.utils.prune keeps ``weight_orig``, a full-size ``weight_mask`` buffer, and a forward pre-hook that
    computes ``weight`` from them: sharded, ``weight_orig`` would be a 1-D shard the hook multiplies by the mask."""
    pruned = [_fqn(name, hook._tensor_name) for name, m in root.named_modules()
              for hook in m._forward_pre_hooks.values() if isinstance(hook, prune.BasePruningMethod)]
    if pruned:
        raise ValueError(
            f"lightning_shard: {pruned[:4]} carry torch.nn.utils.prune reparametrizations (`*_orig` times a `*_mask`"
            " buffer, recomputed before each forward), which sharding would apply to 1-D shards. Make them permanent"
            " before sharding (`torch.nn.utils.prune.remove(module, name)`: the pruned weights become ordinary"
            " weights, whose zeros training may change), or prune the consolidated model after training.")


def refuse_mixed_devices(plan: UnitPlan) -> None:
    """A unit's parameters share its buffers: they must be on one device (dtypes may differ: mixed_layout.py)."""
    devices = {p.device for p, _ in plan.params}
    if len(devices) > 1:
        names = [_fqn(*locs[0]) for _, locs in plan.params]
        raise ValueError(f"Unit {plan.name!r} mixes devices {sorted(map(str, devices))} among its parameters {names};"
                         " give these modules one device before sharding.")


def refuse_sparse_gradients(root: nn.Module) -> None:
    """``nn.Embedding(sparse=True)`` (and ``EmbeddingBag``) make sparse gradients, which no flat buffer holds and no
    reduce-scatter sums (FSDP and DeepSpeed refuse them too): refused at setup, naming the modules."""
    sparse = [name or "<root>" for name, m in root.named_modules() if getattr(m, "sparse", False) is True
              and isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    if sparse:
        raise ValueError(f"lightning_shard: {sparse} make sparse gradients (`sparse=True`), which cannot be sharded"
                         " or reduce-scattered: build them with sparse=False (the default), whose dense gradients"
                         " any torch.optim optimizer takes.")


def refuse_aliased_parameters(root: nn.Module) -> None:
    """Two parameter objects over the same memory (peft's ``ensure_weight_tying`` makes lm_head's LoRA weights
    ``nn.Parameter(embed_B.t())``): plain torch keeps two leaves, each with its gradient and its optimizer state,
    stepping one memory twice. Sharded, each would get its own copy and the tie would break silently (6.7e-3 off
    DDP after a few steps). A tie by identity (one Parameter under two names) is what sharding keeps."""
    spans: dict[int, list[tuple[int, int, str]]] = {}
    seen: set[int] = set()
    for module_name, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None or id(param) in seen or not param.numel():
                continue
            seen.add(id(param))
            first = param.storage_offset()
            last = first + sum((size - 1) * stride for size, stride in zip(param.shape, param.stride()))
            spans.setdefault(param.untyped_storage()._cdata, []).append(
                (first * param.element_size(), (last + 1) * param.element_size(), _fqn(module_name, attr)))
    for found in spans.values():
        found.sort()
        for (_, end, name), (start, _, other) in zip(found, found[1:]):
            if start < end:
                raise ValueError(
                    f"lightning_shard: parameters {name!r} and {other!r} are two Parameter objects over the same memory"
                    " (a tie by views, as peft's `ensure_weight_tying=True` makes for LoRA on tied embeddings), which"
                    " sharding cannot keep: each would be sharded and stepped on its own copy. Tie them by identity"
                    " (one Parameter under both names), or leave them untied (peft: `ensure_weight_tying=False`, or"
                    " LoRA on one of the two modules).")


def _fqn(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr
