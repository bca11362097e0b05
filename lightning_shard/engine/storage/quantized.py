"""Packed 4-bit weights (bitsandbytes ``Params4bit``) held as a unit's bytes (engine/storage/mixed_shard.py).

A ``Params4bit`` holds the packed 4-bit values (two per byte) in its ``quant_storage`` dtype, shape ``(n, 1)``, and
a ``quant_state``: ``absmax`` (one scale per block of ``blocksize`` values), ``code`` (the 16 values of nf4 or fp4),
the weight's shape and dtype, and with double quantization (``compress_statistics``) the absmax itself quantized
(uint8) with a nested state (its own absmax, a 256-value code, blocksize 256) and an ``offset``.

In a unit the packed data and every tensor of its quantization state are slots of the unit's byte buffer: sharded,
gathered, checkpointed and loaded as bytes, never cast, never trained. The state's slots are named as bitsandbytes
names them in a state dict (``<weight>.absmax``, ``<weight>.quant_map``, ``<weight>.nested_absmax``,
``<weight>.nested_quant_map``; and ``<weight>.nested_offset``, which bitsandbytes packs into its
``quant_state.bitsandbytes__<type>`` entry) and are registered nowhere in the module tree. The gathered weight is a
real ``Params4bit`` whose ``quant_state`` views the gathered buffer, so bitsandbytes' own kernels compute with it.
Sharding the state with the unit, not replicating it per rank, saves ``absmax``'s 1/16 byte per weight (1/64 with
double quantization) times ``world - 1`` on every rank: on 8 ranks, as much again as a rank's share of the packed
weights when double quantization is off.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

STATE_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "nested_offset")


def is_params4bit(tensor: object) -> bool:
    cls = type(tensor)
    return cls.__name__ == "Params4bit" and cls.__module__.startswith("bitsandbytes")


def refuse_other_quantized(tensor: object, name: str) -> None:
    """Quantized parameters whose state lives beside their data in a form this module does not know (bitsandbytes'
    8-bit ``Int8Params``: ``SCB``; torchao's tensor subclasses) would be gathered without it: refused."""
    cls = type(tensor)
    if cls.__module__.split(".")[0] in ("bitsandbytes", "torchao") and not is_params4bit(tensor):
        raise ValueError(f"lightning_shard: {name!r} is a {cls.__module__}.{cls.__name__}, a quantized parameter whose"
                         " state this strategy does not shard (bitsandbytes' 4-bit Params4bit is supported: load in"
                         " 4 bits, BitsAndBytesConfig(load_in_4bit=True)).")


@dataclass(frozen=True)
class QuantSpec:
    """What a packed weight's quantization is, besides its tensors (the same on every rank)."""

    weight: str  # the packed weight's name; its state's slots are ``f"{weight}.{key}"``
    blocksize: int
    quant_type: str  # "nf4" or "fp4"
    dtype: torch.dtype  # of the weight before quantization (what dequantization gives back)
    shape: torch.Size  # of the weight before quantization
    quant_storage: torch.dtype
    nested_blocksize: Optional[int] = None  # double quantization: the absmax's own blocks
    nested_dtype: Optional[torch.dtype] = None

    @property
    def nested(self) -> bool:
        return self.nested_blocksize is not None

    @property
    def block_bytes(self) -> int:
        """Packed bytes per quantization block: a shard boundary on a multiple of it splits no block."""
        return self.blocksize // 2

    def state_name(self, key: str) -> str:
        return f"{self.weight}.{key}"

    @property
    def keys(self) -> tuple[str, ...]:
        return STATE_KEYS if self.nested else STATE_KEYS[:2]


def describe(param: nn.Parameter, name: str) -> tuple[QuantSpec, Tensor, list[tuple[str, Tensor]]]:
    """The spec of a ``Params4bit``, its packed data and its state's tensors by state key. Not quantized yet and on
    the meta device (a model built there, ``replace_with_bnb_linear``): what quantizing it will make, on meta."""
    if param.requires_grad:
        raise ValueError(f"lightning_shard: {name!r} is a packed 4-bit weight with requires_grad=True: packed weights"
                         " cannot train (train LoRA adapters beside them, peft's QLoRA); freeze it.")
    if not param.bnb_quantized and param.is_meta:
        return _planned(param, name, torch.device("meta"))
    state = param.quant_state
    if state is None or not param.bnb_quantized:
        raise ValueError(
            f"lightning_shard: {name!r} is a bitsandbytes Params4bit not quantized yet (bitsandbytes quantizes it when"
            " it is moved to a device): move the model to its device first (`model.to('cpu')` or `.cuda()`), load it"
            " with from_pretrained(quantization_config=...), or build it on the meta device and load its weights"
            " with lightning_shard.load_pretrained after sharding.")
    if getattr(state, "packing_format_for_cpu", False):
        raise ValueError(
            f"lightning_shard: {name!r} was repacked by bitsandbytes for CPU inference (an eval-mode forward without"
            " gradients on an AVX512-BF16 CPU), a layout its training kernels do not read. Shard the model before"
            " running it in eval mode (sharded layers never repack).")
    spec = QuantSpec(name, state.blocksize, state.quant_type, state.dtype, torch.Size(state.shape),
                     param.data.dtype, *((state.state2.blocksize, state.state2.dtype) if state.nested else ()))
    tensors = [("absmax", state.absmax), ("quant_map", state.code)]
    if state.nested:
        tensors += [("nested_absmax", state.state2.absmax), ("nested_quant_map", state.state2.code),
                    ("nested_offset", state.offset.reshape(1).float())]
    return spec, param.detach(), tensors


def _planned(param: Any, name: str, device: torch.device,
             tables: bool = True) -> tuple[QuantSpec, Tensor, list[tuple[str, Tensor]]]:
    """What bitsandbytes' quantization of ``param`` (not quantized) makes, as zeros on ``device`` (its code tables
    as they are): packed values two per byte, one absmax per block (uint8 with double quantization, whose nested
    state has blocksize 256)."""
    numel, storage, blocksize = param.numel(), param.quant_storage, param.blocksize or 64
    packed_bytes = (numel + 1) // 2
    if packed_bytes % storage.itemsize:
        raise ValueError(f"lightning_shard: {name!r} ({tuple(param.shape)}) packs into {packed_bytes} bytes, which"
                         f" {storage} storage cannot hold whole: bitsandbytes could not quantize it either.")
    nested = bool(param.compress_statistics)
    spec = QuantSpec(name, blocksize, param.quant_type, param.dtype, torch.Size(param.shape), storage,
                     *((256, torch.float32) if nested else ()))
    blocks = -(-numel // blocksize)
    meta = device.type == "meta" or not tables
    tensors = [("absmax", torch.zeros(blocks, dtype=torch.uint8 if nested else torch.float32, device=device)),
               ("quant_map", _code(spec.quant_type, device, meta))]
    if nested:
        tensors += [("nested_absmax", torch.zeros(-(-blocks // 256), device=device)),
                    ("nested_quant_map", _code("dynamic", device, meta)),
                    ("nested_offset", torch.zeros(1, device=device))]
    return spec, torch.zeros(packed_bytes // storage.itemsize, 1, dtype=storage, device=device), tensors


def _code(kind: str, device: torch.device, meta: bool) -> Tensor:
    """bitsandbytes' code table: the 16 values of nf4 or fp4, or the 256 of its dynamic map (nested absmax)."""
    if meta:
        return torch.empty(256 if kind == "dynamic" else 16, device=device)
    from bitsandbytes.functional import create_dynamic_map, get_4bit_type

    return create_dynamic_map().to(device) if kind == "dynamic" else get_4bit_type(kind, device=device)


def materialize(param: Any, name: str, module: Optional[nn.Module], device: torch.device, tables: bool = True) -> Any:
    """A ``Params4bit`` built on the meta device, made real as its quantization will be, all zeros (its code tables
    as they are; ``tables=False``: left empty, under fake tensors), without its full-precision weight ever
    existing: ``load_pretrained`` fills it after sharding (quantizing each rank's part of each weight)."""
    spec, packed, tensors = _planned(param, name, device, tables)
    return params4bit(packed, spec, dict(tensors), module)


def quant_state(spec: QuantSpec, states: dict[str, Tensor], alive: Optional[Callable[[], bool]] = None) -> Any:
    """A bitsandbytes ``QuantState`` over ``states`` (by key: views of a gathered buffer, or full tensors). ``alive``:
    whether the gathered buffer they view has its storage; reading its tensors while not is an error naming the weight
    (a state kept from inside ``keep_gathered()`` and read after it read freed memory: a segfault)."""
    from bitsandbytes.functional import QuantState

    make = QuantState if alive is None else _guarded_class(QuantState)
    guard = {} if alive is None else {"_alive": alive, "_weight": spec.weight}
    state2, offset = None, None
    if spec.nested:
        state2 = make(absmax=states["nested_absmax"], code=states["nested_quant_map"],
                      blocksize=spec.nested_blocksize, dtype=spec.nested_dtype, **guard)
        offset = states["nested_offset"].view(())
    return make(absmax=states["absmax"], shape=spec.shape, code=states["quant_map"], blocksize=spec.blocksize,
                quant_type=spec.quant_type, dtype=spec.dtype, offset=offset, state2=state2, **guard)


_GUARDED: dict[type, type] = {}


def _guarded_class(base: type) -> type:
    """``base`` (bitsandbytes' QuantState) whose tensors are read through a check that their buffer is gathered."""
    if base not in _GUARDED:
        def tensor(key: str) -> property:
            def read(self: Any) -> Any:
                value = self.__dict__[key]
                if isinstance(value, Tensor) and not self.__dict__["_alive"]():
                    raise RuntimeError(
                        f"lightning_shard: the quantization state of {self.__dict__['_weight']!r} was read after its"
                        " unit was freed (kept from inside keep_gathered() or a step, whose gathered buffer it views):"
                        " read it inside, or keep a copy (`absmax.clone()`, `quant_state.to(device)` makes new"
                        " tensors).")
                return value

            def write(self: Any, value: Any) -> None:
                self.__dict__[key] = value

            return property(read, write)

        def init(self: Any, *args: Any, _alive: Callable[[], bool], _weight: str, **kwargs: Any) -> None:
            self.__dict__["_alive"], self.__dict__["_weight"] = _alive, _weight
            base.__init__(self, *args, **kwargs)

        members = {key: tensor(key) for key in ("absmax", "code", "offset")}
        name = f"Gathered{base.__name__}"
        _GUARDED[base] = globals()[name] = type(name, (base,), {"__init__": init, "__module__": __name__, **members})
    return _GUARDED[base]


def params4bit(data: Tensor, spec: QuantSpec, states: dict[str, Tensor], module: Optional[nn.Module] = None,
               alive: Optional[Callable[[], bool]] = None) -> Any:
    """A real ``Params4bit`` viewing ``data`` (packed, shape ``(n, 1)``) with its quantization state: what
    bitsandbytes' ``Linear4bit.forward`` and peft's dequantization read (``alive``: see :func:`quant_state`)."""
    from bitsandbytes.nn import Params4bit

    return Params4bit(data, requires_grad=False, quant_state=quant_state(spec, states, alive), blocksize=spec.blocksize,
                      compress_statistics=spec.nested, quant_type=spec.quant_type, quant_storage=spec.quant_storage,
                      module=module, bnb_quantized=True)


def replacement(new: Any, spec: QuantSpec) -> tuple[QuantSpec, dict[Optional[str], Tensor]]:
    """What a ``Params4bit`` put in place of a gathered packed weight (peft's merge re-quantizes it) holds, by state key
    (``None``: the packed data), and its spec; refused where it is quantized otherwise than the slot. Its ``dtype``,
    what dequantization gives back, may differ (peft's merge quantizes base + adapter, promoted to the adapter's)."""
    if not is_params4bit(new) or new.is_meta or not new.bnb_quantized:
        raise RuntimeError(f"lightning_shard: the packed 4-bit weight {spec.weight!r} was replaced by a"
                           f" {type(new).__name__} that is not a quantized bitsandbytes Params4bit: a sharded 4-bit"
                           " weight can only be replaced by one quantized as it is (shape, blocksize, type, storage).")
    theirs, data, tensors = describe(new, spec.weight)
    if replace(theirs, dtype=spec.dtype) != spec:
        raise RuntimeError(f"lightning_shard: the packed 4-bit weight {spec.weight!r} was replaced by one quantized as"
                           f" {theirs}, where the sharded model's is {spec}: quantize the replacement as the model is.")
    return theirs, {None: data, **dict(tensors)}


def adopt(module: nn.Module, weight: Any) -> None:
    """``module`` (a ``Linear4bit``) computes with the gathered ``weight``: its own copy of the quantization state
    (bitsandbytes keeps one for FSDP's sake) is that weight's, so the full one is freed; and it never repacks the
    weight for CPU inference, which would replace the gathered data with a new tensor."""
    if hasattr(module, "quant_state"):
        module.quant_state = weight.quant_state
    if hasattr(module, "support_avx512bf16_for_cpu"):
        module.support_avx512bf16_for_cpu = False


def check_bias(module: nn.Module, bias_dtype: torch.dtype, name: str) -> None:
    """``Linear4bit.forward`` casts its bias in place (``bias.data = ...``) to the compute dtype when they differ,
    which would detach the gathered bias from the buffer that gathers refill: refused at setup."""
    compute = getattr(module, "compute_dtype", None)
    if getattr(module, "bias", None) is not None and compute != bias_dtype:
        raise ValueError(
            f"lightning_shard: the 4-bit layer {name!r} has a {bias_dtype} bias (as gathered) and compute dtype"
            f" {compute}: bitsandbytes would cast the bias in place at its first forward, replacing the tensor that"
            " gathers refill. Give them one dtype: bnb_4bit_compute_dtype (BitsAndBytesConfig) equal to the bias's,"
            " or the bias in the compute dtype before sharding.")


def full_parameters(slots: list, values: list[Tensor], requires_grad: list[bool]) -> list[nn.Parameter]:
    """Parameters over ``values`` (each slot's full tensor, in its shape) to register in the module tree in place of
    the shards: a packed weight's a ``Params4bit`` with its quantization state (the state's slots' values), so that
    bitsandbytes' own ``_save_to_state_dict`` writes the state under its names."""
    by_name = {slot.names[0]: value for slot, value in zip(slots, values)}
    params = []
    for slot, value, trains in zip(slots, values, requires_grad):
        spec = getattr(slot, "quant", None)
        if spec is None:
            params.append(nn.Parameter(value, requires_grad=trains))
        else:
            params.append(params4bit(value, spec, {key: by_name[spec.state_name(key)] for key in spec.keys}))
    return params


# -- loading: each rank quantizes its part of a weight ---------------------------------------------------------------
def quantize_part(values: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor]:
    """The packed bytes and the fp32 absmax of a run of whole blocks of a weight (flat, in any float dtype), as
    bitsandbytes' quantization of the whole weight gives them for those blocks: blockwise quantization is local."""
    import bitsandbytes  # noqa: F401  (registers its ops)

    packed, absmax = torch.ops.bitsandbytes.quantize_4bit.default(values.to(spec.dtype), spec.blocksize,
                                                                  spec.quant_type, torch.uint8)
    return packed.reshape(-1), absmax.float()


def state_tensors(absmax: Tensor, spec: QuantSpec) -> dict[str, Tensor]:
    """The quantization state's tensors of a weight whose fp32 absmax (all its blocks) is ``absmax``: double
    quantization as bitsandbytes' ``quantize_4bit`` does it (the mean is over every block: it needs them all)."""
    from bitsandbytes.functional import get_4bit_type, quantize_blockwise

    states = {"absmax": absmax, "quant_map": get_4bit_type(spec.quant_type, device=absmax.device)}
    if spec.nested:
        offset = absmax.mean()
        qabsmax, state2 = quantize_blockwise(absmax - offset, blocksize=spec.nested_blocksize)
        states.update(absmax=qabsmax, nested_absmax=state2.absmax, nested_quant_map=state2.code,
                      nested_offset=offset.reshape(1).float())
    return states


def read_blob(blob: Tensor, spec: QuantSpec, source_name: str) -> dict[str, Any]:
    """The non-tensor quantization state bitsandbytes packs into ``<weight>.quant_state.bitsandbytes__<type>``,
    checked against the model's: another quantization cannot be loaded into these bytes."""
    from bitsandbytes.utils import unpack_tensor_to_dict

    saved = unpack_tensor_to_dict(blob)
    mine = {"quant_type": spec.quant_type, "blocksize": spec.blocksize, "shape": list(spec.shape),
            "nested_blocksize": spec.nested_blocksize}
    theirs = {key: (list(value) if key == "shape" else value) for key, value in saved.items() if key in mine}
    theirs.setdefault("nested_blocksize", None)
    if theirs != mine:
        raise ValueError(f"lightning_shard: {source_name!r} was quantized as {theirs}, the model's"
                         f" {spec.weight!r} as {mine}: quantize the model as the weights were (BitsAndBytesConfig).")
    return saved


def materialize_unit(root: nn.Module, plan: Any, device: torch.device) -> None:
    """The unit's 4-bit weights built on the meta device, made real (:func:`materialize`) before the rest of the unit
    is: their full-precision values never exist. Their layers' biases start at zero (an init would read the weight's
    shape as a float tensor's); ``load_pretrained`` fills both."""
    for i, (param, locations) in enumerate(plan.params):
        if not (is_params4bit(param) and param.is_meta and not param.bnb_quantized):
            continue
        module = root.get_submodule(locations[0][0])
        real = materialize(param, ".".join(filter(None, locations[0])), module, device)
        for name, attr in locations:
            root.get_submodule(name)._parameters[attr] = real
        plan.params[i] = (real, locations)
        bias = getattr(module, "bias", None)
        if bias is not None and bias.is_meta:
            module.bias = nn.Parameter(torch.zeros_like(bias, device=device), requires_grad=bias.requires_grad)
