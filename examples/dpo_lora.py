"""Preference tuning: DPO with LoRA under ShardStrategy, the reference model being the same peft model with its
adapter disabled (TRL's ``ref_model=None``), trained on 2 CPU processes, then checked against one process that trains
the same model on the same global batches.

    python examples/dpo_lora.py                                # a tiny Llama folder made on the fly, nothing downloaded
    python examples/dpo_lora.py --base path/to/Llama-3.2-1B --steps 100 --prompt 128 --completion 64

Preference pairs from real text (Python's standard-library documentation, ``lightning_shard.app.data.text``): a
prompt, the text's own continuation (chosen) and the same tokens shuffled (rejected). The loss is DPO's (the
``sigmoid`` loss of TRL's DPOTrainer): ``-logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))`` over
the completions' summed log-probabilities, the reference's computed by the same model under ``disable_adapter()``
and ``no_grad``. Rank 0 then trains the model again in one process on the global batches the ranks saw, and compares
the adapter that ``SavePretrained`` wrote and the losses with its own; at ``32-true`` the script fails where they
differ by more than 1e-6. Writes into ``--out``: ``tiny-llama/`` (when made here) and ``adapter/``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hf_lora import tiny_llama_folder, token_ids  # (examples/hf_lora.py: the tiny Llama, the text as its tokens)
from lightning_shard import SavePretrained, ShardStrategy


def preference_pairs(ids: torch.Tensor, prompt: int, completion: int) -> TensorDataset:
    """Consecutive windows of the text: (prompt, its real continuation, that continuation's tokens shuffled)."""
    windows = ids[: len(ids) // (prompt + completion) * (prompt + completion)].view(-1, prompt + completion)
    prompts, chosen = windows[:, :prompt], windows[:, prompt:]
    g = torch.Generator().manual_seed(0)
    rejected = torch.stack([row[torch.randperm(completion, generator=g)] for row in chosen])
    return TensorDataset(prompts, chosen, rejected)


def lora_model(base: Path):
    """The policy: the folder's model with peft's LoRA. Its reference is the same model with the adapter disabled."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # ("Loading weights": a bar per load of a tiny model)
    torch.manual_seed(0)  # the adapter's init: the same on every rank, and in the one-process check
    model = AutoModelForCausalLM.from_pretrained(base)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    return get_peft_model(model, lora).train()


def completion_logps(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Each sequence's log-probability of its completion (the tokens after the first ``prompt``), summed."""
    logits = model(input_ids=ids, use_cache=False).logits[:, prompt - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, prompt:, None]).squeeze(-1).sum(-1)


def dpo_loss(model, prompts: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> torch.Tensor:
    # chosen and rejected in one forward, as TRL's DPOTrainer runs them: the batch is [prompt+chosen; prompt+rejected]
    ids, prompt = torch.cat([torch.cat([prompts, chosen], 1), torch.cat([prompts, rejected], 1)]), prompts.shape[1]
    policy_chosen, policy_rejected = completion_logps(model, ids, prompt).chunk(2)
    with torch.no_grad(), model.disable_adapter():  # the reference: the base model, no gradient, no second copy
        ref_chosen, ref_rejected = completion_logps(model, ids, prompt).chunk(2)
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -F.logsigmoid(beta * margin).mean()


class DPOLoRA(L.LightningModule):
    def __init__(self, base: Path, beta: float, lr: float) -> None:
        super().__init__()
        self.beta, self.lr = beta, lr
        self.model = lora_model(base)  # (a base too big for one process: build it on the meta device, see hf_lora.py)
        self.losses: list[float] = []  # per step, the mean over the ranks

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = dpo_loss(self.model, *batch, beta=self.beta)
        self.losses.append(float(self.all_gather(loss.detach()).mean()))
        self.log("dpo_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def one_process(base: Path, data: TensorDataset, args: argparse.Namespace) -> tuple[dict, list[float]]:
    """The same training in one process: at each step the global batch (every rank's batch, rebuilt with the
    DistributedSampler Lightning gave the ranks), its gradient the mean of the ranks' (each rank's loss is a mean
    over as many pairs). Returns the trained adapter and the losses."""
    from peft import get_peft_model_state_dict

    model = lora_model(base)
    if args.perturb_reference:  # (for the test that the check fails: the reference's start moved)
        with torch.no_grad():
            next(p for p in model.parameters() if p.requires_grad).add_(args.perturb_reference)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    loaders = []
    for rank in range(args.devices):
        sampler = DistributedSampler(data, num_replicas=args.devices, rank=rank, shuffle=True, seed=0)
        loaders.append(DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True))
    losses = []
    for _, batches in zip(range(args.steps), zip(*loaders)):
        total = 0.0
        for batch in batches:
            loss = dpo_loss(model, *batch, beta=args.beta) / args.devices
            loss.backward()
            total += float(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return get_peft_model_state_dict(model), losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=None, help="a Hugging Face causal-LM folder (default: a tiny"
                        " Llama made in --out)")
    parser.add_argument("--out", type=Path, default=Path("dpo_lora_out"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt", type=int, default=48, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=16, help="tokens per completion")
    parser.add_argument("--batch", type=int, default=4, help="pairs per rank")
    parser.add_argument("--beta", type=float, default=0.5, help="DPO's beta (TRL's default: 0.1)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--perturb-reference", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per process
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.base or tiny_llama_folder(args.out / "tiny-llama")
    L.seed_everything(0)  # (the DistributedSampler's shuffling seed: the one-process check rebuilds it)
    from transformers import AutoConfig

    data = preference_pairs(token_ids(base, AutoConfig.from_pretrained(base).vocab_size), args.prompt, args.completion)
    module = DPOLoRA(base, args.beta, args.lr)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, precision=args.precision, max_steps=args.steps,
        strategy=ShardStrategy(save_frozen=False),  # checkpoints would hold the adapter, not the base
        callbacks=[SavePretrained(args.out / "adapter")],  # the adapter folder, at the end of fit
        logger=False, enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=10,
    )
    trainer.fit(module, DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True))

    if trainer.global_rank == 0:
        from safetensors.torch import load_file

        k = max(1, min(10, len(module.losses) // 4))
        print(f"DPO loss on {args.devices} ranks, mean of the first and the last {k} of {len(module.losses)} steps:"
              f" {sum(module.losses[:k]) / k:.4f} -> {sum(module.losses[-k:]) / k:.4f}")
        adapter, losses = one_process(base, data, args)
        saved = load_file(args.out / "adapter" / "adapter_model.safetensors")
        assert saved.keys() == adapter.keys(), sorted(set(saved) ^ set(adapter))
        weights = max(float((saved[k] - v).abs().max()) for k, v in adapter.items())
        loss = max(abs(a - b) for a, b in zip(module.losses, losses, strict=True))
        print(f"one process on the global batches against {args.devices} ranks: max |adapter difference| "
              f"{weights:.2e}, max |loss difference| {loss:.2e}")
        if args.precision == "32-true" and max(weights, loss) > 1e-6:  # elsewhere the ranks compute in bf16
            raise SystemExit(f"the sharded run differs from one process by {max(weights, loss):.2e} (more than 1e-6)")


if __name__ == "__main__":
    main()
