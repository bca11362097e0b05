"""4-bit weights written dequantized (``export.py``): a packed weight's slot comes with its quantization state's
slots (``engine/storage/quantized.py``), one at a time from the gather; held until all have come, then dequantized by
bitsandbytes (``dequantize_4bit``, what transformers' ``dequantize()`` and peft's merge call) into the dtype the
weight was quantized from."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch import Tensor

from lightning_shard.engine.storage import quantized


class Dequantizer:
    def __init__(self) -> None:
        self.waiting: dict[str, tuple[Any, Optional[Tensor], dict[str, Optional[Tensor]]]] = {}  # by weight name
        self.owner: dict[str, str] = {}  # a state slot's name -> its weight's

    def take(self, slot: Any, value: Optional[Tensor]) -> tuple[Optional[Any], Optional[Tensor]]:
        """``(slot, value)`` as the export goes on with them: a plain parameter as it is; a 4-bit weight, once its
        state has come, as its dequantized weight (its slot in that shape); ``(None, None)`` meanwhile."""
        spec = getattr(slot, "quant", None)
        if spec is not None:
            self.waiting[spec.weight] = (slot, value, {})
            self.owner.update({spec.state_name(key): spec.weight for key in spec.keys})
        elif slot.names[0] in self.owner:
            weight = self.owner.pop(slot.names[0])
            self.waiting[weight][2][slot.names[0].rsplit(".", 1)[1]] = value
        else:
            return slot, value
        name = spec.weight if spec is not None else weight
        packed_slot, packed, states = self.waiting[name]
        if len(states) < len(packed_slot.quant.keys):
            return None, None
        del self.waiting[name]
        return self._dequantized(packed_slot, packed, states)

    def _dequantized(self, slot: Any, packed: Optional[Tensor], states: dict[str, Optional[Tensor]]
                     ) -> tuple[Any, Optional[Tensor]]:
        spec = slot.quant
        plain = dataclasses.replace(slot, shape=spec.shape, numel=spec.shape.numel(), quant=None, packed=False,
                                    master_dtype=spec.dtype, gather_dtype=spec.dtype)
        if packed is None:  # a rank that does not write
            return plain, None
        from bitsandbytes.functional import dequantize_4bit

        return plain, dequantize_4bit(packed, quantized.quant_state(spec, states))

    def check_done(self) -> None:
        if self.waiting:
            raise RuntimeError(f"save_pretrained: the quantization state of {sorted(self.waiting)[:4]} was not all"
                               " found: their 4-bit weights cannot be dequantized.")
