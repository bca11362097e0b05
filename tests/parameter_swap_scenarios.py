"""Scenarios for test_parameter_swaps.py, run inside a gloo world: inside ``keep_gathered()``, parameters given other
tensors (``p.data = t``: an init drawn on every rank, rank 0's kept) or replaced by other Parameter objects
(``module.weight = nn.Parameter(...)``; peft's ``merge_adapter()`` on a 4-bit base installs a re-quantized weight).
With ``modifier_rank`` the modifier's values become every rank's shards; without, the exit refuses, naming them."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module
from tests.fsdp2_port_common import MLP
from tests.gradient_write_scenarios import Adapted  # a bf16 base and an fp32 adapter in one unit
from tests.mixed_paths_scenarios import lora_llama


def _model(kind: str) -> tuple[nn.Module, list[str]]:
    torch.manual_seed(0)
    if kind == "mixed":
        return nn.Sequential(Adapted(), Adapted()), ["Adapted"]
    return nn.Sequential(nn.Linear(8, 8), MLP(), MLP()), ["MLP"]


def _draw(model: nn.Module, rank: int, how: str) -> dict[str, torch.Tensor]:
    """Each rank draws its own values for every parameter and gives them ``how``: ``rebind`` (``p.data = t``) or
    ``replace`` (a new Parameter object in the module); returns what it drew, by name."""
    g = torch.Generator().manual_seed(100 + rank)
    drawn = {}
    for module_name, module in model.named_modules():
        for attr, param in list(module._parameters.items()):
            if param is None:
                continue
            value = torch.randn(param.shape, generator=g).to(param.dtype)
            drawn[f"{module_name}.{attr}" if module_name else attr] = value
            if how == "rebind":
                param.data = value.clone()
            else:
                setattr(module, attr, nn.Parameter(value.clone(), requires_grad=param.requires_grad))
    return drawn


def kept_from_the_modifier(rank: int, world: int, kind: str, how: str, modifier: int) -> dict[str, float]:
    """Per parameter, how far the sharded model's values after the block are from the modifier rank's draws (0.0
    expected); then one SGD step against one process holding those values (the tree computes with them)."""
    model, units = _model(kind)
    runtime = shard_module(model, units=units)
    with runtime.keep_gathered(modifier_rank=modifier):
        drawn = _draw(model, rank, how)
    everyone = [None] * world
    dist.all_gather_object(everyone, drawn)
    expected = everyone[modifier]
    full = full_state_dict(runtime, rank0_only=False)
    off = {name: float((full[name].double() - value.double()).abs().max()) for name, value in expected.items()}
    reference, _ = _model(kind)
    reference.load_state_dict(expected)
    x = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(7))
    for net, data in ((model, x.chunk(world)[rank]), (reference, x)):
        trained = [p for p in net.parameters() if p.requires_grad]
        net(data).pow(2).mean().backward()
        torch.optim.SGD(trained, lr=0.5).step()
    full = full_state_dict(runtime, rank0_only=False)
    # (relative: the drawn weights make gradients of hundreds, summed by the ranks in another order)
    off["after a step, relative"] = max(float((full[n].double() - v.double()).abs().max() / v.double().abs().max())
                                        for n, v in reference.state_dict().items())
    return off


def refused_without_a_modifier(rank: int, world: int, kind: str, how: str) -> str:
    model, units = _model(kind)
    runtime = shard_module(model, units=units)
    try:
        with runtime.keep_gathered():
            _draw(model, rank, how)
    except RuntimeError as err:
        return str(err)
    return "nothing raised"


def wrong_shape_refused(rank: int, world: int) -> str:
    model, units = _model("plain")
    runtime = shard_module(model, units=units)
    try:
        with runtime.keep_gathered(modifier_rank=0):
            model[1].in_proj.weight = nn.Parameter(torch.zeros(3, 3))
    except RuntimeError as err:
        return str(err)
    return "nothing raised"


def lora_merged_inside(rank: int, world: int, base: str) -> dict[str, float]:
    """peft's ``merge_adapter()`` inside ``keep_gathered(modifier_rank=0)``, on LoRA over a bf16 base (``.data +=``)
    and over a 4-bit base (a new, re-quantized ``Params4bit``); the logits after, in another block, against one
    process merging the same model (train mode: bitsandbytes repacks 4-bit weights for an eval forward on the CPU)."""
    from tests.qlora_scenarios import qlora_model

    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    out = {}
    for name, build in (("bf16 base", lambda: lora_llama(("q_proj", "v_proj"))),
                        ("4-bit base", lambda: qlora_model(base, "nf4", "uint8", True))):
        torch.manual_seed(3)
        reference = build()
        with torch.no_grad():  # adapters that change the model (peft's default zero B would merge nothing)
            for param_name, param in reference.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(param_name)))
        model = copy.deepcopy(reference)
        runtime = shard_module(model, units=["LlamaDecoderLayer"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft: merging into 4 bits rounds
            with runtime.keep_gathered(modifier_rank=0), torch.no_grad():
                before = model(input_ids=ids).logits
                model.merge_adapter()
            reference.merge_adapter()
        with runtime.keep_gathered(), torch.no_grad():
            logits = model(input_ids=ids).logits
        with torch.no_grad():
            expected = reference(input_ids=ids).logits
        out[name] = float((logits.float() - expected.float()).abs().max())
        out[f"{name}: the merge's effect"] = float((before.float() - expected.float()).abs().max())
    return out


def quant_state_kept(rank: int, world: int, base: str) -> str:
    """A 4-bit weight's quantization state kept from inside keep_gathered() and read after it (it read the freed
    gathered buffer: a segfault); read inside, it is the weight's."""
    from tests.qlora_scenarios import qlora_model

    model = qlora_model(base, "nf4", "uint8", True)
    runtime = shard_module(model, units=["LlamaDecoderLayer"])
    layer = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    with runtime.keep_gathered():
        state = layer.weight.quant_state
        inside = float(state.absmax.float().abs().sum()) + float(state.state2.absmax.abs().sum())
    assert inside > 0
    try:
        state.absmax.float().sum()
    except RuntimeError as err:
        return str(err)
    return "nothing raised"
