"""Scenarios for test_peft_patterns.py, run inside a gloo world: what peft does to parameters behind the strategy's
back, against one process on the same global batch (fp32, rtol 1e-5 / atol 1e-6): the reference pass through
``disable_adapter()`` (which sets the adapters' ``requires_grad`` to False for the pass and back after), adapters
switched by ``set_adapter()`` between two passes of one loss, and ties made by views (refused at setup)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module
from tests.hf_scenarios import tiny_llama


def lora_llama(adapters: tuple[str, ...] = ("default",), targets: tuple[str, ...] = ("q_proj", "v_proj"),
               **config):
    """A tiny fp32 Llama with peft's LoRA adapters (B drawn, not zero: every pass depends on them)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = tiny_llama()
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights="gaussian", **config)
    model = get_peft_model(base, lora, adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model


def sequence_logps(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return torch.gather(logits.log_softmax(-1), 2, ids[:, 1:, None]).squeeze(-1).sum(-1)


def dpo_loss(model, chosen: torch.Tensor, rejected: torch.Tensor, reference_grad: bool) -> torch.Tensor:
    """DPO with one peft model: the policy's log-probabilities, then the reference's through ``disable_adapter()``
    (TRL's ``ref_model=None``), under ``no_grad`` (or with grad: it then reaches no adapter)."""
    chosen_logps, rejected_logps = sequence_logps(model, chosen), sequence_logps(model, rejected)
    with (torch.enable_grad() if reference_grad else torch.no_grad()), model.disable_adapter():
        ref_chosen, ref_rejected = sequence_logps(model, chosen), sequence_logps(model, rejected)
    margin = (chosen_logps - ref_chosen) - (rejected_logps - ref_rejected)
    return -F.logsigmoid(0.1 * margin).mean()


def two_adapters_loss(model, chosen: torch.Tensor, rejected: torch.Tensor, _reference_grad: bool) -> torch.Tensor:
    """A loss over passes with two adapters, switched by ``set_adapter()`` (which freezes the inactive one): only the
    adapter active when backward runs trains, as in plain torch (its accumulation reads ``requires_grad`` then)."""
    model.set_adapter("other")
    other = sequence_logps(model, rejected)
    model.set_adapter("default")
    return -(sequence_logps(model, chosen) - other).mean() * 0.01


LOSSES = {"dpo": dpo_loss, "two_adapters": two_adapters_loss}


def against_one_process(rank: int, world: int, loss: str, reference_grad: bool, mode: str = "full",
                        steps: int = 3) -> float:
    """``steps`` AdamW steps of the sharded model and of one process on the same global batch (the reference's
    gradient: the mean of the per-rank chunks'); the largest difference of any weight after them."""
    adapters = ("default", "other") if loss == "two_adapters" else ("default",)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 128, (2 * world, 10), generator=g), torch.randint(0, 128, (2 * world, 10), generator=g))
            for _ in range(steps)]
    reference = lora_llama(adapters)
    model = copy.deepcopy(reference)
    runtime = shard_module(model, sharding=mode, units=["LlamaDecoderLayer"])
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    for chosen, rejected in data:
        for chunk in range(world):
            (LOSSES[loss](reference, chosen.chunk(world)[chunk], rejected.chunk(world)[chunk], reference_grad)
             / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        LOSSES[loss](model, chosen.chunk(world)[rank], rejected.chunk(world)[rank], reference_grad).backward()
        opt.step()
        opt.zero_grad()
    full = full_state_dict(runtime, rank0_only=False)
    moved = max(float((v - lora_llama(adapters).state_dict()[k]).abs().max()) for k, v in reference.state_dict().items()
                if "lora_" in k)
    assert moved > 1e-3, f"the adapters did not train in the reference ({moved})"
    return max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())


def tied_by_views(rank: int, world: int, on_meta: bool) -> str:
    """peft's ``ensure_weight_tying=True`` with LoRA on tied embeddings: lm_head's A and B are new Parameters viewing
    embed_tokens' B and A transposed. Refused at setup, naming them (each was sharded apart: 6.7e-3 off DDP)."""
    from peft import LoraConfig, get_peft_model

    with torch.device("meta") if on_meta else torch.device("cpu"):
        base = tiny_llama()
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["embed_tokens", "lm_head", "q_proj"],
                                            ensure_weight_tying=True))
    try:
        shard_module(model, units=["LlamaDecoderLayer"])
    except ValueError as err:
        return str(err)
    return "nothing raised"


def dora_on_meta(rank: int, world: int, folder: str) -> dict[str, float]:
    """DoRA on a base built on the meta device under ShardStrategy, the base loaded by slices in ``on_fit_start``
    (it was refused at setup: "Cannot materialise ... lora_magnitude_vector"): its magnitudes after the load against
    ``get_peft_model`` on ``from_pretrained``'s base (one process), and two AdamW steps against DDP from there."""
    import lightning as L
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_shard import ShardStrategy, load_pretrained
    from tests.world import as_lightning_rank

    as_lightning_rank(rank, world)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True)
    ids = torch.randint(0, 96, (2 * world, 10), generator=torch.Generator().manual_seed(4))

    class DoRA(L.LightningModule):
        def __init__(self, on_meta: bool) -> None:
            super().__init__()
            self.on_meta, self.model, self.after_load, self.losses = on_meta, None, None, []

        def configure_model(self) -> None:
            if self.model is None:
                if self.on_meta:
                    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
                else:
                    base = AutoModelForCausalLM.from_pretrained(folder)
                self.model = get_peft_model(base, lora)

        def on_fit_start(self) -> None:
            if self.on_meta:
                load_pretrained(self, folder)
                runtime = self.trainer.strategy.runtime
                self.after_load = {k: v for k, v in full_state_dict(runtime, rank0_only=False).items()}

        def training_step(self, batch, _):
            loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    fits = {}
    for name, on_meta, strategy in (("sharded", True, ShardStrategy(units=["LlamaDecoderLayer"])),
                                    ("ddp", False, "ddp")):
        torch.manual_seed(0)
        module = DoRA(on_meta)
        if not on_meta:  # the same adapters as the sharded run drew (rank 0's), A and B: only the base comes from disk
            module.configure_model()
            adapters = {k.removeprefix("model."): v for k, v in fits["sharded"]["after_load"].items() if "lora_" in k}
            assert not module.model.load_state_dict(adapters, strict=False).unexpected_keys
            fits["reference magnitudes"] = {n: p.detach().clone() for n, p in module.model.named_parameters()
                                            if "lora_magnitude_vector" in n}
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False)
        trainer.fit(module, torch.utils.data.DataLoader([ids.chunk(world)[rank]] * 2, batch_size=None))
        state = (full_state_dict(trainer.strategy.runtime, rank0_only=False) if on_meta
                 else {f"model.{k}": v for k, v in module.model.state_dict().items()})
        fits[name] = {"after_load": module.after_load, "state": state, "losses": module.losses}
    loaded = fits["sharded"]["after_load"]
    magnitudes = {n: float((loaded[f"model.{n}"] - v).abs().max()) for n, v in fits["reference magnitudes"].items()}
    trained = max(float((fits["sharded"]["state"][k] - v).abs().max()) for k, v in fits["ddp"]["state"].items())
    return {"magnitudes": max(magnitudes.values()), "count": len(magnitudes), "after two steps": trained}
