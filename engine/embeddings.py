"""Embeddings that enter the model in place of token embeddings (the
multimodal path: image or audio features projected to the model's width).

Each Embedding takes a fresh, never reused range of reserved token ids, far
above any vocabulary; a prompt places those ids where the embedding belongs.
Because the ids are unique to the object, the prefix cache's page hashes
(which cover the token ids) already tell embeddings apart: the same object
reuses its pages, a different one — even with equal values — never does.
"""

from __future__ import annotations

import itertools
import threading

import torch

#: First reserved id; vocabularies are far smaller.
EMBEDDING_ID_BASE = 1 << 40

_next_id = itertools.count(EMBEDDING_ID_BASE)
_id_lock = threading.Lock()


class Embedding:
    """A [n, hidden_size] tensor bound to n reserved token ids."""

    def __init__(self, vectors: torch.Tensor) -> None:
        if vectors.dim() != 2 or vectors.shape[0] == 0:
            raise ValueError(
                f"embedding vectors must be a non-empty [n, hidden_size] tensor, got {tuple(vectors.shape)}")
        self.vectors = vectors
        with _id_lock:
            first = next(_next_id)
            for _ in range(vectors.shape[0] - 1):
                next(_next_id)
        self.first_id = first

    @property
    def token_ids(self) -> list[int]:
        """The ids to put in input_ids where this embedding goes."""
        return list(range(self.first_id, self.first_id + self.vectors.shape[0]))

    def __len__(self) -> int:
        return self.vectors.shape[0]
