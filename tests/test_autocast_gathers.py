"""Gathers in bf16 of only what autocast casts to bf16 anyway (engine/plan/gathers.py) make a bf16-mixed step DDP's under
the same autocast: the first forward bit for bit, then within 1e-5 (the ranks sum gradients in another order), on an
fp32 HF Llama trained whole (tied and untied head) and a QLoRA base; FSDP's gathers (every floating parameter in bf16)
differ by bf16 roundings of the embeddings, norms and residual stream."""

from __future__ import annotations

import pytest

from tests import autocast_gather_scenarios as s
from tests.mixed_scenarios import write_base
from tests.world import run_world

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("model,cast_params", [("llama", "autocast"), ("tied llama", "autocast"),
                                               ("qlora", "default")])
def test_bf16_mixed_matches_ddp_under_autocast(model, cast_params, tmp_path):
    """QLoRA with bf16-mixed as it comes (its default gathers are autocast's: its units hold several dtypes, or train
    nothing); an fp32 Llama trained whole with MixedPrecision(torch.bfloat16, cast_params="autocast")."""
    write_base(str(tmp_path))
    r = run_world(s.against_ddp, 2, model, str(tmp_path), cast_params, timeout=550)[0]
    assert r["losses"][0] == r["ddp_losses"][0], r  # the first forward, bit for bit
    assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ddp_losses"])) <= 1e-5, r
    assert r["weights"] <= 1e-5, r
    gathered = r["gathered"]
    embedding = next(k for k in gathered if k.endswith("embed_tokens.weight"))
    assert gathered[embedding] == "torch.float32", gathered  # an embedding: as autocast leaves it
    norms = [k for k in gathered if "norm" in k]
    assert norms and all(gathered[k] == "torch.float32" for k in norms), gathered
    linear = [k for k, v in gathered.items() if k.endswith(("o_proj.weight", "lora_A.default.weight"))
              and v != "torch.uint8"]  # (a 4-bit o_proj: its packed bytes)
    assert linear and all(gathered[k] == "torch.bfloat16" for k in linear), gathered


@pytest.mark.parametrize("cast_params", ["all", "default"])
def test_gathering_every_parameter_in_bf16_differs_from_ddp_under_autocast(cast_params, tmp_path):
    """FSDP's gathers ("all"), which bf16-mixed keeps by default for units trained whole (its "auto"): the embeddings
    and norms in bf16 differ from DDP by bf16 roundings (so the test above can fail)."""
    write_base(str(tmp_path))
    r = run_world(s.against_ddp, 2, "llama", str(tmp_path), cast_params, timeout=550)[0]
    assert r["losses"][0] != r["ddp_losses"][0] and r["weights"] > 1e-4, r
    assert r["gathered"]["model.model.embed_tokens.weight"] == "torch.bfloat16", r["gathered"]


def test_autocast_gathers_move_at_most_15_percent_more_bytes_than_all_bf16_on_the_840m_llama():
    """The 840M Llama shape of `python -m lightning_shard.bench --device cuda --model hf-llama` (16 layers, hidden
    2048, vocab 32000, untied), built on the meta device and counted, not trained: a step all-gathers each layer
    twice (forward, backward) but the last (kept for the backward it begins), and the root once (its embedding in fp32
    under "autocast", 2 bytes a parameter more)."""
    from argparse import Namespace

    import torch

    from lightning_shard.engine.plan.gathers import GatherDtypes
    from lightning_shard.engine.plan.plan import plan_units
    from lightning_shard.tools.bench_models import build_model

    with torch.device("meta"):
        model = build_model(Namespace(model="hf-llama", depth=16, width=2048, heads=16, seq=1024, vocab=32000))
    plans = [plan for plan in plan_units(model, units=["LlamaDecoderLayer"]) if plan.params]
    assert 0.8e9 < sum(plan.numel() for plan in plans) < 0.9e9

    def step_bytes(cast_params: str) -> int:
        gathers = GatherDtypes(model, torch.bfloat16, cast_params)
        per_unit = [sum(p.numel() * gathers.of(p, loc).itemsize for p, loc in plan.params) for plan in plans]
        roots = [i for i, plan in enumerate(plans) if plan.members == [""]]
        layers = [b for i, b in enumerate(per_unit) if i not in roots]
        return 2 * sum(layers) - layers[-1] + sum(per_unit[i] for i in roots)

    ratio = step_bytes("autocast") / step_bytes("all")
    assert 1.0 < ratio <= 1.15, ratio
