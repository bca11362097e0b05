"""Character-level language-modelling data from real English text that ships with Python itself:
the documentation strings of standard-library modules. Nothing is downloaded."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

STDLIB_MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "email", "functools", "heapq", "http.client", "inspect", "itertools", "json", "logging",
    "multiprocessing", "pathlib", "pickle", "re", "shutil", "socket", "sqlite3", "statistics", "string",
    "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.request", "uuid", "zipfile",
)


def stdlib_docs_text() -> str:
    """Docstrings of the modules above and of their public members (about 220 KB of English prose)."""
    parts = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr, member in sorted(vars(module).items()):
            if not attr.startswith("_") and getattr(member, "__module__", None) == module.__name__:
                parts.append(inspect.getdoc(member) or "")
    return "\n\n".join(p for p in parts if p)


def token_ids(folder: Path, vocab_size: int) -> torch.Tensor:
    """The text as a Hugging Face model's tokens: its folder's tokenizer, or bytes (a folder without one, as the
    examples' tiny Llama, whose vocabulary is the 256 bytes)."""
    text = stdlib_docs_text()
    try:
        from transformers import AutoTokenizer

        return torch.tensor(AutoTokenizer.from_pretrained(folder)(text).input_ids)
    except (OSError, ValueError):  # no tokenizer in the folder
        return torch.tensor(list(text.encode()), dtype=torch.long) % vocab_size


class CharChunks(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` characters (inputs and shifted targets)."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.ids, self.seq_len = ids, seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i * self.seq_len : (i + 1) * self.seq_len + 1]


class CharTextDataModule(L.LightningDataModule):
    def __init__(self, seq_len: int = 128, batch_size: int = 8, val_fraction: float = 0.05,
                 test_fraction: float = 0.05) -> None:
        super().__init__()
        self.seq_len, self.batch_size = seq_len, batch_size
        text = stdlib_docs_text()
        self.vocab = sorted(set(text))
        lookup = {ch: i for i, ch in enumerate(self.vocab)}
        ids = torch.tensor([lookup[ch] for ch in text], dtype=torch.long)
        val_start = int(len(ids) * (1 - val_fraction - test_fraction))
        test_start = int(len(ids) * (1 - test_fraction))
        self.train_ids, self.val_ids, self.test_ids = ids[:val_start], ids[val_start:test_start], ids[test_start:]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(CharChunks(self.train_ids, self.seq_len), batch_size=self.batch_size, shuffle=True,
                          drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(CharChunks(self.val_ids, self.seq_len), batch_size=self.batch_size, drop_last=True)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(CharChunks(self.test_ids, self.seq_len), batch_size=self.batch_size, drop_last=True)
