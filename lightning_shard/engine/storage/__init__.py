"""Shards: a unit's parameters stored 1/N per rank, the views that give each parameter its tensor when gathered, and
where the shard lives (the device, or host memory under offload).

    flat_shard.py       one flat padded buffer per unit, this rank's shard, shard and gathered parameters
    slots.py            where one parameter lives in it, and the guard on its shard parameter
    unsharded_grads.py  the gradients taken off the gathered parameters (summed in the reduction's dtype in no_sync)
    outside.py          a unit's parameters reaching code outside it (returned copies, reads that gather)
    offload.py          where a shard lives offloaded (HostMaster, held by either layout): its master in host
                        memory, copies to the device, gradient shards to the host
    mixed_shard.py      a unit of several dtypes (a bf16 base beside fp32 adapters) in one byte buffer
    mixed_layout.py     where each of its parameters lies, and which rank holds each trainable one
    quantized.py        bitsandbytes' 4-bit weights as packed bytes with their quantization state
    unit.py             a unit: its storage and its state during a step
"""
