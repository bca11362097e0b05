"""Scenarios for test_pretrained.py (issue 32), run inside a gloo world: a Hugging Face folder in (several
safetensors shards), a few sharded training steps, a folder out, loaded back with ``from_pretrained`` in one
process and compared with the sharded model's own logits."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.checkpoint.export import save_pretrained
from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.checkpoint.pretrained import load_pretrained
from lightning_shard.engine.shard_module import shard_module
from tests.world import as_lightning_rank

VOCAB = 128


def llama_config(tied: bool = True):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied, attn_implementation="eager")


def write_base(folder: str, tied: bool = True, seed: int = 0) -> None:
    """A tiny Llama (GQA, tied embeddings) as ``save_pretrained`` writes it, in several safetensors shards."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlamaForCausalLM(llama_config(tied)).save_pretrained(folder, max_shard_size="20KB")


def lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def _train(model: nn.Module, rank: int, world: int, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(5)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2 * world, 12), generator=g).chunk(world)[rank]
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def round_trip(rank: int, world: int, base: str, out: str) -> dict:
    """Full fine-tuning and LoRA: load the base folder into a sharded model, train, export, reload in one process
    (rank 0). Returns the largest logit differences and the files written."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    report: dict = {}
    torch.manual_seed(100 + rank)  # other values than the folder's, and than the other ranks': loading must fill all
    full = LlamaForCausalLM(llama_config())
    shard_module(full)
    assert load_pretrained(full, base) == ([], [])
    loaded = _logits(full)  # a sharded forward: every rank
    if rank == 0:
        report["loaded"] = float((loaded - _logits(AutoModelForCausalLM.from_pretrained(base))).abs().max())
    _train(full, rank, world)
    save_pretrained(full, Path(out) / "full", max_shard_size="20KB")
    trained = _logits(full)
    if rank == 0:
        report["full"] = float((_logits(AutoModelForCausalLM.from_pretrained(Path(out) / "full")) - trained).abs().max())
        report["full_files"] = sorted(p.name for p in (Path(out) / "full").iterdir())
        report["full_config"] = json.loads((Path(out) / "full" / "config.json").read_text())

    torch.manual_seed(200 + rank)
    adapted = lora(LlamaForCausalLM(llama_config()))
    shard_module(adapted)
    assert load_pretrained(adapted, base) == ([], [])  # the base weights, under peft's names
    _train(adapted, rank, world)
    save_pretrained(adapted, Path(out) / "adapter")
    save_pretrained(adapted, Path(out) / "merged", merged=True)
    trained = _logits(adapted)
    if rank == 0:
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), Path(out) / "adapter")
        report["adapter"] = float((_logits(reloaded) - trained).abs().max())
        report["adapter_files"] = sorted(p.name for p in (Path(out) / "adapter").iterdir())
        merged = AutoModelForCausalLM.from_pretrained(Path(out) / "merged")
        report["merged"] = float((_logits(merged) - trained).abs().max())
        plain = lora(AutoModelForCausalLM.from_pretrained(base))  # the adapter folder into an unsharded peft model
        load_pretrained(plain, Path(out) / "adapter")
        report["adapter_loaded"] = float((_logits(plain) - trained).abs().max())
    torch.manual_seed(300 + rank)  # and back into a sharded one: the adapter folder, names mapped by peft's rules
    again = lora(AutoModelForCausalLM.from_pretrained(base) if rank == 0 else LlamaForCausalLM(llama_config()))
    shard_module(again)
    load_pretrained(again, base)
    assert load_pretrained(again, Path(out) / "adapter") == ([], [])
    report["adapter_resharded"] = float((_logits(again) - trained).abs().max())
    dist.barrier()
    return report


def wrong_folders(rank: int, world: int, base: str, adapter: str) -> list[str]:
    """What a user gets for a folder that does not fit: the errors, one per case."""
    from transformers import LlamaForCausalLM

    errors = []
    config = copy.deepcopy(llama_config())
    config.num_hidden_layers = 1
    for case in ("fewer layers", "adapter into a plain model", "no weights"):
        model = LlamaForCausalLM(llama_config() if case != "fewer layers" else config)
        shard_module(model)
        path = {"fewer layers": base, "adapter into a plain model": adapter, "no weights": "/"}[case]
        try:
            load_pretrained(model, path)
            errors.append(f"{case}: loaded")
        except Exception as err:  # noqa: BLE001 - the message is what is tested
            errors.append(f"{case}: {type(err).__name__}: {err}")
    return errors


# -- a LoRA run through Lightning: checkpoints of the adapter alone, resumed, refused on another base ------------
def _lora_classes():
    import lightning as L
    from transformers import LlamaForCausalLM

    class LoraModule(L.LightningModule):
        def __init__(self, base: str, chunk: slice) -> None:
            super().__init__()
            self.model, self.base, self.chunk = None, base, chunk

        def configure_model(self) -> None:  # on the meta device under ShardStrategy: no rank holds the model
            if self.model is None:
                torch.manual_seed(7)
                self.model = lora(LlamaForCausalLM(llama_config()))

        def on_fit_start(self) -> None:
            load_pretrained(self, self.base)  # the model is sharded by now; a checkpoint is restored after this
            full = full_state_dict(self.trainer.strategy.runtime, rank0_only=False)
            self.start_b = max(float(v.abs().max()) for k, v in full.items() if "lora_B" in k)  # peft's init: 0

        def training_step(self, batch, _):
            ids = batch[self.chunk]
            return self.model(input_ids=ids, labels=ids, use_cache=False).loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    return L, LoraModule


def lora_fit(rank: int, world: int, base: str, work: str, resume: bool) -> dict:
    """4 epochs of LoRA under ShardStrategy(save_frozen=False), checkpointing every epoch and writing the adapter
    at the end (SavePretrained); or (``resume``) the same run resumed from its epoch-1 checkpoint on this world.
    Returns the trained adapter's weights and the sharded model's logits (rank 0)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_shard import SavePretrained, ShardStrategy

    as_lightning_rank(rank, world)
    L, LoraModule = _lora_classes()
    size = 6 // world
    module = LoraModule(base, slice(rank * size, (rank + 1) * size))
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.DataLoader([torch.randint(0, VOCAB, (6, 12), generator=g) for _ in range(4)],
                                       batch_size=None)
    out = Path(work) / ("resumed" if resume else "first")
    callbacks = [SavePretrained(out / "adapter"),
                 ModelCheckpoint(out / "checkpoints", filename="{epoch}", save_top_k=-1, every_n_epochs=1)]
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=ShardStrategy(save_frozen=False), max_epochs=4,
                        logger=False, callbacks=callbacks, use_distributed_sampler=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, data, ckpt_path=str(Path(work) / "first" / "checkpoints" / "epoch=1.ckpt") if resume else None)
    with trainer.strategy.keep_gathered():
        logits = _logits(module.model)
    full = full_state_dict(trainer.strategy.runtime, rank0_only=False)
    return {"adapter": {k: v for k, v in full.items() if "lora_" in k}, "logits": logits,
            "saved": sorted(p.name for p in (out / "checkpoints").iterdir()), "start_b": module.start_b}


def lora_resume_on_another_base(rank: int, world: int, other_base: str, work: str) -> str:
    """The run's epoch-1 checkpoint restored onto another base model: refused, naming it. Returns the error."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    L, LoraModule = _lora_classes()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=ShardStrategy(save_frozen=False), max_epochs=4,
                        logger=False, enable_checkpointing=False, use_distributed_sampler=False,
                        enable_progress_bar=False, enable_model_summary=False)
    data = torch.utils.data.DataLoader([torch.zeros(6, 12, dtype=torch.long)], batch_size=None)
    try:
        trainer.fit(LoraModule(other_base, slice(None)), data,
                    ckpt_path=str(Path(work) / "first" / "checkpoints" / "epoch=1.ckpt"))
    except Exception as err:  # noqa: BLE001 - the message is what is tested
        return f"{type(err).__name__}: {err}"
    return "resumed"


# -- figures for the README: `python -m tests.pretrained_scenarios` ---------------------------------------------
def checkpoint_sizes(rank: int, world: int, work: str) -> dict:
    """A LoRA model (Llama, 24.6M base parameters, r=8 on q and v) after one AdamW step, checkpointed sharded
    with its frozen base and without it: the bytes each checkpoint holds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.fingerprint import frozen_names
    from lightning_shard.checkpoint.io import save_sharded

    config = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    runtime = shard_module(model)
    with runtime.shaped_parameters():
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    runtime.attach_optimizer(opt)
    ids = torch.randint(0, 8000, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    runtime.step(opt)
    sizes = {}
    for kind, skip in (("with the base", set()), ("save_frozen=False", frozen_names(runtime))):
        path = Path(work) / kind
        save_sharded({"state_dict": sharded.model_state(runtime, skip=skip),
                      "optimizer_states": [sharded.optimizer_state(runtime, opt)]}, path)
        sizes[kind] = sum(p.stat().st_size for p in path.iterdir())
    slots = [slot for unit in runtime.units for slot in unit.storage.slots]
    counts = {"base": sum(s.numel for s in slots if "lora_" not in s.names[0]),
              "adapter": sum(s.numel for s in slots if "lora_" in s.names[0])}
    return {**sizes, **counts}


if __name__ == "__main__":
    import tempfile

    from tests.world import run_world

    with tempfile.TemporaryDirectory() as directory:
        sizes = run_world(checkpoint_sizes, 2, directory, timeout=600)[0]
    print(f"LoRA on Llama: base {sizes['base'] / 1e6:.1f}M parameters, adapter"
          f" {sizes['adapter'] / 1e6:.2f}M; sharded checkpoint with the base {sizes['with the base'] / 1e6:.1f} MB,"
          f" with save_frozen=False {sizes['save_frozen=False'] / 1e6:.2f} MB")


# -- habits of real fine-tuning setups: a classification head saved whole, ties, other adapter settings ----------
def copies_from_a_base(rank: int, world: int, base: str) -> float:
    """A LoRA with ``modules_to_save`` (peft trains a copy of the head) built before the base is loaded, as on the meta
    device: loading the base folder fills the copy too, as peft's wrapping of a loaded model copies it. The largest
    logit difference from the base model (the adapter starts as a no-op)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)  # another init than the base's
    model = get_peft_model(LlamaForCausalLM(llama_config(tied=False)), LoraConfig(
        r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], lora_dropout=0.0))
    shard_module(model)
    assert load_pretrained(model, base) == ([], [])  # strict: every weight of the model found, the copy's too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = LlamaForCausalLM.from_pretrained(base)
    return float((_logits(model) - _logits(reference)).abs().max())


def edges(rank: int, world: int, base: str, work: str) -> dict:
    """A sequence-classification LoRA (peft saves the head whole: ``modules_to_save``) exported as adapter and
    merged; a merge into a tied weight and a mismatched adapter refused on every rank; a module holding two models."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForSequenceClassification, LlamaForCausalLM, LlamaForSequenceClassification

    report: dict = {}
    config = llama_config(tied=False)
    config.num_labels, config.pad_token_id = 3, 0
    torch.manual_seed(0)
    lora_config = LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(LlamaForSequenceClassification(config), lora_config)
    shard_module(model)
    load_pretrained(model, base, strict=False)  # the base's body; the new head stays as initialised
    g = torch.Generator().manual_seed(2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        ids = torch.randint(1, VOCAB, (2 * world, 8), generator=g).chunk(world)[rank]
        labels = torch.randint(0, 3, (2 * world,), generator=g).chunk(world)[rank]
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    save_pretrained(model, Path(work) / "cls-adapter")
    save_pretrained(model, Path(work) / "cls-merged", merged=True)
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    if rank == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            body = AutoModelForSequenceClassification.from_pretrained(base, num_labels=3, pad_token_id=0)
            adapted = PeftModel.from_pretrained(body, Path(work) / "cls-adapter")
            merged = AutoModelForSequenceClassification.from_pretrained(Path(work) / "cls-merged")
        with torch.no_grad():
            report["cls adapter"] = float((adapted(input_ids=ids).logits - trained).abs().max())
            report["cls merged"] = float((merged(input_ids=ids).logits - trained).abs().max())
    tied = get_peft_model(LlamaForCausalLM(llama_config()), LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    shard_module(tied)
    for case, call in (("merge into a tie", lambda: save_pretrained(tied, Path(work) / "tied", merged=True)),
                       ("other lora_alpha", lambda: load_pretrained(
                           get_peft_model(LlamaForCausalLM(llama_config()), LoraConfig(r=4, lora_alpha=32,
                                                                                       target_modules=["q_proj"])),
                           Path(work) / "cls-adapter"))):
        try:
            call()
            report[case] = "done"
        except Exception as err:  # noqa: BLE001 - the message is what is tested
            report[case] = f"{type(err).__name__}: {err}"
    dist.barrier()
    return report


def base_folder_into_a_task_model(rank: int, world: int, folder: str) -> dict:
    """A folder saved from ``LlamaModel`` (no head, no ``model.`` prefix) into a sharded module holding an untied
    ``LlamaForCausalLM``, as ``from_pretrained`` takes it: the base filled, the head as it was built."""
    from transformers import LlamaForCausalLM, LlamaModel

    holder = nn.Module()
    torch.manual_seed(0)  # every rank builds the same head
    holder.model = LlamaForCausalLM(llama_config(tied=False))
    head = holder.model.lm_head.weight.detach().clone()
    shard_module(holder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_pretrained(holder, folder)
    full = full_state_dict(holder._shard_runtime, rank0_only=False)
    saved = LlamaModel.from_pretrained(folder).state_dict()
    return {"loaded": loaded, "base": all(torch.equal(full[f"model.model.{k}"], v) for k, v in saved.items()),
            "head": torch.equal(full["model.lm_head.weight"], head),
            "warned": [str(w.message) for w in caught if "holds the base model" in str(w.message)]}


def into_a_submodule(rank: int, world: int, base: str, out: str, sharding: str) -> dict:
    """``load_pretrained(self.model, folder)`` and ``save_pretrained(self.model, folder)`` as users write them in a
    LightningModule: the HF model inside a sharded module, which has no runtime of its own (its root's is used). The
    largest differences from ``from_pretrained``'s weights, and from the sharded model's after a step."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(llama_config())
            self.extra = nn.Linear(4, 4)  # beside the model: neither loaded nor missing

    torch.manual_seed(100 + rank)
    holder = Holder()
    runtime = shard_module(holder, sharding=sharding)
    report: dict = {"loaded": load_pretrained(holder.model, base)}
    full = full_state_dict(runtime, rank0_only=False)
    expected = AutoModelForCausalLM.from_pretrained(base).state_dict()
    report["load"] = max(float((full[f"model.{k}"] - v).abs().max()) for k, v in expected.items())
    _train(holder.model, rank, world, steps=1)
    full = full_state_dict(runtime, rank0_only=False)
    save_pretrained(holder.model, out)
    if rank == 0:
        saved = LlamaForCausalLM.from_pretrained(out).state_dict()
        report["save"] = max(float((full[f"model.{k}"] - v).abs().max()) for k, v in saved.items())
    return report
