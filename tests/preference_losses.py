"""TRL's preference losses with peft, written as one LightningModule (no dependency on ``trl``), for
preference_scenarios.py. Ported from huggingface/trl at f2cd577:

- DPO (``trl/trainer/dpo_trainer.py``, ``_compute_loss``): chosen and rejected in one forward (the batch is
  ``[chosen; rejected]``), completion log-probabilities summed over the completion mask, the ``sigmoid`` loss
  ``-logsigmoid(beta * delta)``, with cDPO's label smoothing as TRL computed it before its refactor (#3906:
  ``-logsigmoid(beta d) (1 - e) - logsigmoid(-beta d) e``; the same loss at ``e = 0``).
- ORPO (``trl/experimental/orpo/orpo_trainer.py``): no reference model; the NLL of the chosen sequences over prompt and
  completion, minus ``beta * logsigmoid(log_odds)`` of the completion-averaged log-probabilities (``log1mexp``).
- KTO (``trl/trainer/kto_trainer.py``): unpaired desirable/undesirable completions; the KL estimate from mismatched
  pairs (each prompt with the previous example's completion), through the policy and the reference under ``no_grad``,
  averaged over the ranks (TRL's ``gather_for_metrics``) and clamped at 0; ``1 - sigmoid(beta (logratio - kl))``.

The reference, as TRL takes it: ``ref_model=None`` with a peft model (``disable_adapter()`` under ``no_grad``, TRL's
``use_adapter(model, None)``), log-probabilities precomputed in a first pass over the dataset
(``precompute_ref_log_probs``: each rank its share, gathered, stored as columns the batches carry), or a separate
frozen copy of the base (``ref_model=...``)."""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

VOCAB, PROMPT, COMPLETION = 96, 4, 6


def lora_llama(seed: int = 0, ref_adapter: bool = False, base: str = "fp32", folder: Optional[str] = None):
    """A tiny Llama (tests/mixed_scenarios.py's config) with peft's LoRA on q, v and o (B drawn, not zero: the policy
    differs from the reference from the first step, and every adapter matrix gets a gradient); and a frozen copy of
    its base, built before peft wraps it, for ``ref_model=...``. ``base``: "fp32"; "bf16" (HF's usual recipe: the
    base in bf16, peft's adapters in fp32); "nf4" (QLoRA: ``folder`` loaded 4-bit by bitsandbytes, prepared for k-bit
    training; no copy). ``ref_adapter``: a second adapter "ref", a copy of the first (TRL's reference when
    re-training an existing adapter), frozen as peft adds it."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    from tests.mixed_scenarios import llama_config

    torch.manual_seed(seed)
    if base == "nf4":
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        model = LlamaForCausalLM.from_pretrained(folder, quantization_config=config, device_map="cpu",
                                                 dtype=torch.bfloat16)
        model, frozen = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False), None
    else:
        model = LlamaForCausalLM(llama_config()).to(torch.bfloat16 if base == "bf16" else torch.float32)
        frozen = copy.deepcopy(model).requires_grad_(False)
    torch.manual_seed(seed + 1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0,
                      init_lora_weights="gaussian")
    model = get_peft_model(model, lora).train()  # (from_pretrained returns eval mode, which Lightning keeps)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    if ref_adapter:
        model.add_adapter("ref", lora)
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, param in params.items():
                if ".ref." in name:
                    param.copy_(params[name.replace(".ref.", ".default.")])
    return model, frozen


class Columns(Dataset):
    """A dataset of named columns (TRL's ``datasets.Dataset`` after tokenization); the precomputed reference adds
    columns after the sharded model exists, before the first batch is read."""

    def __init__(self, **columns: torch.Tensor) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict:
        return {name: column[i] for name, column in self.columns.items()}


def _completions(g: torch.Generator, prompts: torch.Tensor, follow: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded completions of 3 to 6 tokens: the prompt's count continued (``follow``) or random tokens."""
    n = len(prompts)
    if follow:
        ids = (prompts[:, -1:] + torch.arange(1, COMPLETION + 1)) % VOCAB
    else:
        ids = torch.randint(1, VOCAB, (n, COMPLETION), generator=g)
    lengths = torch.randint(3, COMPLETION + 1, (n,), generator=g)
    mask = (torch.arange(COMPLETION) < lengths[:, None]).long()
    return ids * mask, mask  # pad id 0


def pairs(n: int, seed: int = 3) -> Columns:
    """DPO's and ORPO's data: a prompt, a chosen and a rejected completion."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, VOCAB, (n, PROMPT), generator=g)
    chosen, chosen_mask = _completions(g, prompts, follow=True)
    rejected, rejected_mask = _completions(g, prompts, follow=False)
    return Columns(index=torch.arange(n), prompt=prompts, chosen=chosen, chosen_mask=chosen_mask,
                   rejected=rejected, rejected_mask=rejected_mask)


def unpaired(n: int, per_device: int, seed: int = 3) -> Columns:
    """KTO's data: a prompt, one completion and its label (desirable every other example), and the KL completion
    TRL's ``add_kl_completion_ids`` gives: the previous completion within each chunk of ``per_device`` examples."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, VOCAB, (n, PROMPT), generator=g)
    label = torch.arange(n) % 2 == 0
    good, good_mask = _completions(g, prompts, follow=True)
    bad, bad_mask = _completions(g, prompts, follow=False)
    completion = torch.where(label[:, None], good, bad)
    mask = torch.where(label[:, None], good_mask, bad_mask)
    cycled = torch.cat([chunk.roll(1, 0) for chunk in torch.arange(n).split(per_device)])
    return Columns(index=torch.arange(n), prompt=prompts, completion=completion, completion_mask=mask, label=label,
                   KL_completion=completion[cycled], KL_completion_mask=mask[cycled])


def sequence(prompt: torch.Tensor, completion: torch.Tensor, mask: torch.Tensor) -> dict:
    """Prompt and completion as one right-padded sequence, with TRL's ``completion_mask``."""
    return {"input_ids": torch.cat([prompt, completion], 1),
            "attention_mask": torch.cat([torch.ones_like(prompt), mask], 1),
            "completion_mask": torch.cat([torch.zeros_like(prompt), mask], 1)}


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """TRL's ``selective_log_softmax`` (trl/trainer/utils.py): logsumexp in fp32, log_softmax per row in bf16."""
    index = index.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        logsumexp = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return (torch.gather(logits, -1, index) - logsumexp.unsqueeze(-1)).squeeze(-1)
    return torch.stack([F.log_softmax(row, -1).gather(-1, i) for row, i in zip(logits, index)]).squeeze(-1)


def completion_logps(logits: torch.Tensor, seq: dict, average: bool = False) -> torch.Tensor:
    per_token = selective_log_softmax(logits[:, :-1], seq["input_ids"][:, 1:])
    mask = seq["completion_mask"][:, 1:]
    per_token = per_token.masked_fill(mask == 0, 0.0)
    return per_token.sum(-1) / mask.sum(-1) if average else per_token.sum(-1)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """ORPO's ``log(1 - exp(x))``, branched at -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class PreferenceTuning(L.LightningModule):
    """``loss``: "dpo", "orpo" or "kto", on ``data`` (the training set); ``reference``: "disable_adapter" (``ref_model=None``), "ref_adapter"
    (a second adapter), "precomputed" (or "precomputed_held") or "copy". Keeps this rank's loss of every micro-batch and, under DDP, the gradient norm before clipping."""

    def __init__(self, loss: str, data: Columns, reference: str = "disable_adapter", beta: float = 0.1,
                 label_smoothing: float = 0.0, lr: float = 1e-2, checkpointing: Optional[dict] = None,
                 optimizer: str = "adamw", base: str = "fp32", folder: Optional[str] = None) -> None:
        super().__init__()
        self.loss_type, self.data, self.reference, self.beta, self.label_smoothing, self.lr = (
            loss, data, reference, beta, label_smoothing, lr)
        self.model, frozen = lora_llama(ref_adapter=reference == "ref_adapter", base=base, folder=folder)
        self.ref_model = frozen if reference == "copy" else None
        self.checkpointing, self.optimizer = checkpointing, optimizer
        if checkpointing is not None:  # DPOConfig's default (gradient_checkpointing=True), as DPOTrainer sets it up
            self.model.activation_checkpointing_enable(checkpointing)
            self.model.enable_input_require_grads()
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.checkpointed: list[bool] = []
        self.grad_norms: list[float] = []

    # -- the model's log-probabilities, TRL's way ------------------------------------------------------------
    def _logits(self, model, seq: dict) -> torch.Tensor:
        return model(input_ids=seq["input_ids"], attention_mask=seq["attention_mask"], use_cache=False).logits

    @contextmanager
    def _no_checkpointing(self):
        """TRL's ``disable_gradient_checkpointing`` around reference passes (trl/models/utils.py)."""
        if self.checkpointing is None:
            yield
            return
        self.model.activation_checkpointing_disable()
        try:
            yield
        finally:
            self.model.activation_checkpointing_enable(self.checkpointing)

    def reference_logps(self, seq: dict, average: bool = False) -> torch.Tensor:
        with torch.no_grad(), self._no_checkpointing():
            if self.ref_model is not None:
                return completion_logps(self._logits(self.ref_model, seq), seq, average)
            with self._use_adapter("ref" if self.reference == "ref_adapter" else None):
                return completion_logps(self._logits(self.model, seq), seq, average)

    @contextmanager
    def _use_adapter(self, name: Optional[str]):
        """TRL's ``use_adapter`` (trl/trainer/utils.py): ``None`` disables the adapters; a name switches to it with
        ``set_adapter`` (which makes it trainable and freezes the others) and back after."""
        if name is None:
            with self.model.disable_adapter():
                yield
            return
        previous = self.model.active_adapter
        self.model.set_adapter(name)
        try:
            yield
        finally:
            self.model.set_adapter(previous)

    # -- the losses ----------------------------------------------------------------------------------------------
    def dpo(self, batch: dict) -> torch.Tensor:
        both = sequence(batch["prompt"].repeat(2, 1), torch.cat([batch["chosen"], batch["rejected"]]),
                        torch.cat([batch["chosen_mask"], batch["rejected_mask"]]))
        chosen, rejected = completion_logps(self._logits(self.model, both), both).chunk(2)
        if self.reference.startswith("precomputed"):
            ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        else:
            ref_chosen, ref_rejected = self.reference_logps(both).chunk(2)
        delta = (chosen - ref_chosen) - (rejected - ref_rejected)
        losses = (-F.logsigmoid(self.beta * delta) * (1 - self.label_smoothing)
                  - F.logsigmoid(-self.beta * delta) * self.label_smoothing)
        return losses.mean()

    def orpo(self, batch: dict) -> torch.Tensor:
        n = len(batch["prompt"])
        both = sequence(batch["prompt"].repeat(2, 1), torch.cat([batch["chosen"], batch["rejected"]]),
                        torch.cat([batch["chosen_mask"], batch["rejected_mask"]]))
        logits = self._logits(self.model, both)
        labels = torch.where(both["attention_mask"] == 1, both["input_ids"], -100)[:n, 1:]
        nll = F.cross_entropy(logits[:n, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1))
        chosen, rejected = completion_logps(logits, both, average=True).float().chunk(2)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        return nll - (self.beta * F.logsigmoid(log_odds)).mean()

    def kto(self, batch: dict) -> torch.Tensor:
        seq = sequence(batch["prompt"], batch["completion"], batch["completion_mask"])
        mismatched = sequence(batch["prompt"], batch["KL_completion"], batch["KL_completion_mask"])
        with torch.no_grad():  # (TRL's _compute_kl_logps: the policy, no checkpointing context)
            kl_logps = completion_logps(self._logits(self.model, mismatched), mismatched)
        logps = completion_logps(self._logits(self.model, seq), seq)
        if self.reference.startswith("precomputed"):
            ref_kl_logps, ref_logps = batch["ref_KL_logps"], batch["ref_logps"]
        else:
            ref_kl_logps, ref_logps = self.reference_logps(mismatched), self.reference_logps(seq)
        kl = self.all_gather((kl_logps - ref_kl_logps).mean().detach()).mean().clamp(min=0)
        label = batch["label"].bool()
        chosen_losses = 1 - torch.sigmoid(self.beta * ((logps - ref_logps)[label] - kl))
        rejected_losses = 1 - torch.sigmoid(self.beta * (kl - (logps - ref_logps)[~label]))
        return torch.cat([chosen_losses, rejected_losses]).nanmean()  # desirable/undesirable weights 1

    # -- TRL's precompute_ref_log_probs: a first pass over the dataset, before training -----------------------
    def precompute_reference(self, data: Columns) -> None:
        """Each rank computes its share of the examples (every ``world``-th batch of 2), gathered so that every rank
        adds the whole columns (every rank runs the same number of forwards). "precomputed_held": inside the
        sharded model's ``keep_gathered()`` (one all-gather per unit for the whole pass)."""
        rank, world = self.trainer.global_rank, self.trainer.world_size
        mine = torch.arange(len(data)).split(2)[rank::world]
        computed: dict[str, list[torch.Tensor]] = {}
        held = self.reference == "precomputed_held" and hasattr(self.trainer.strategy, "keep_gathered")
        with self.trainer.strategy.keep_gathered() if held else nullcontext(), \
                self.trainer.precision_plugin.forward_context():
            for index in mine:
                batch = {k: v[index] for k, v in data.columns.items()}
                if self.loss_type == "dpo":
                    both = sequence(batch["prompt"].repeat(2, 1), torch.cat([batch["chosen"], batch["rejected"]]),
                                    torch.cat([batch["chosen_mask"], batch["rejected_mask"]]))
                    values = dict(zip(("ref_chosen_logps", "ref_rejected_logps"), self.reference_logps(both).chunk(2)))
                else:
                    values = {"ref_logps": self.reference_logps(sequence(batch["prompt"], batch["completion"],
                                                                        batch["completion_mask"])),
                              "ref_KL_logps": self.reference_logps(sequence(batch["prompt"], batch["KL_completion"],
                                                                           batch["KL_completion_mask"]))}
                for name, value in {"index": index, **values}.items():
                    computed.setdefault(name, []).append(value)
        gathered = {name: self.all_gather(torch.cat(values)).reshape(-1) for name, values in computed.items()}
        order = gathered.pop("index").argsort()
        for name, values in gathered.items():
            data.columns[name] = values[order].float()

    def on_fit_start(self) -> None:
        if self.reference.startswith("precomputed"):
            self.precompute_reference(self.data)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = getattr(self, self.loss_type)(batch)
        self.losses.append(float(loss.detach()))
        self.checkpointed.append(self.model.is_activation_checkpointing)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss = getattr(self, self.loss_type)(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.val_losses.append(float(loss))

    def on_before_optimizer_step(self, optimizer) -> None:
        from lightning_shard import ShardStrategy

        if not isinstance(self.trainer.strategy, ShardStrategy):  # DDP's gradients are whole: their norm is global
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.grad_norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trained = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "sgd":  # a step proportional to the gradient: differences are not amplified as Adam's are
            return torch.optim.SGD(trained, lr=10 * self.lr)
        return torch.optim.AdamW(trained, lr=self.lr, weight_decay=0.1)
