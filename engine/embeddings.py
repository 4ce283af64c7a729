"""Embeddings that enter the model in place of token embeddings (the
multimodal path: image or audio features projected to the model's width).

Each Embedding is bound to a range of reserved token ids, far above any
vocabulary; a prompt places those ids where the embedding belongs, and the
prefix cache's page hashes (which cover the token ids) then tell embeddings
apart with no other key.

Which ids an embedding gets:
- without a `key`, a fresh range never handed out before: the same object
  reuses its pages, a different one (even with equal values) never does;
- with a `key` (a content hash: engine/vision/images.py uses sha256 of the
  preprocessed pixels and the tower's identity), the range the key got first,
  so two jobs with the same image share the pages after it, and different
  keys never share ids. The key is a promise: equal keys mean equal vectors.

The key -> ids registry is process-wide and bounded (least recently used
keys are forgotten past MAX_KEYS). Ids come from one counter and are never
handed out twice, so an id range belongs to at most one key for the life of
the process: two embeddings with the same ids always have the same key, hence
the same vectors. Forgetting a key only makes its next embedding take a fresh
range, which loses sharing with older jobs and never correctness.

A DeferredEmbedding (an image before its tower ran) has its rows, width and key, hence its ids, at
once, and its vectors only when the generator admits its job (engine/encoder_inputs.py).

Bidirectional embeddings (Gemma 3's images): during prefill, the positions of
one maximal run of such rows attend to each other both ways (transformers'
token_type_ids mask: every other position stays causal). bidirectional_spans
names those runs; the batch hands them to attention (kernels/reference.py),
the scheduler never splits one across prefill chunks, and a prefix-cache hit
never ends inside one.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import torch

#: First reserved id; vocabularies are far smaller.
EMBEDDING_ID_BASE = 1 << 40
#: Keys the registry remembers; the least recently used is forgotten past it.
MAX_KEYS = 4096

_next_id = itertools.count(EMBEDDING_ID_BASE)
_id_lock = threading.Lock()
_keys: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (first id, rows)


def _fresh(rows: int) -> int:
    first = next(_next_id)
    for _ in range(rows - 1):
        next(_next_id)
    return first


def _reserve(rows: int, key: str | None) -> int:
    """The first of `rows` reserved ids: the key's range if the registry holds it, else a fresh one."""
    with _id_lock:
        if key is None:
            return _fresh(rows)
        known = _keys.get(key)
        if known is not None:
            first, known_rows = known
            if known_rows != rows:
                raise ValueError(f"embedding key {key!r} already names {known_rows} rows, not {rows}: "
                                 "equal keys must mean equal vectors")
            _keys.move_to_end(key)
            return first
        first = _fresh(rows)
        _keys[key] = (first, rows)
        while len(_keys) > MAX_KEYS:
            _keys.popitem(last=False)
        return first


class Embedding:
    """A [n, hidden_size] tensor bound to n reserved token ids; `key` (optional) names its content, so
    that embeddings with the same key share ids (and prefix-cache pages). `bidirectional`: its rows
    attend to each other both ways in prefill (Gemma 3's images), not only causally."""

    def __init__(self, vectors: torch.Tensor, key: str | None = None, bidirectional: bool = False) -> None:
        if vectors.dim() != 2 or vectors.shape[0] == 0:
            raise ValueError(
                f"embedding vectors must be a non-empty [n, hidden_size] tensor, got {tuple(vectors.shape)}")
        self._bind(vectors.shape[0], vectors.shape[1], key, bidirectional)
        self._vectors: torch.Tensor | None = vectors

    def _bind(self, rows: int, width: int, key: str | None, bidirectional: bool) -> None:
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError(f"embedding key must be a non-empty string or None, got {key!r}")
        self.rows, self.width, self.key, self.bidirectional = rows, width, key, bidirectional
        self.first_id = _reserve(rows, key)

    @property
    def encoded(self) -> bool:
        """Whether the vectors are there (a DeferredEmbedding's come when its job is admitted)."""
        return self._vectors is not None

    @property
    def vectors(self) -> torch.Tensor:
        if self._vectors is None:
            raise RuntimeError(f"embedding {self.key!r} is not encoded yet: its job has not been admitted")
        return self._vectors

    @property
    def token_ids(self) -> list[int]:
        """The ids to put in input_ids where this embedding goes."""
        return list(range(self.first_id, self.first_id + self.rows))

    def __len__(self) -> int:
        return self.rows


class DeferredEncoder(Protocol):
    """What computes DeferredEmbeddings' vectors (engine/vision/images.py's ImageEncoder)."""

    def encode_deferred(self, embeddings: Sequence[DeferredEmbedding]) -> None:
        """Fill every embedding's vectors, in as few model calls as it can; raise if it cannot."""


class DeferredEmbedding(Embedding):
    """An embedding whose vectors are computed when its job is admitted (vLLM v1's encoder inputs
    scheduled with the step): its rows, width and content key are known before, so are its ids, the
    prompt and the prefix-cache hashes. The generator hands the deferred embeddings of a step's
    admissions to their encoder together (engine/encoder_inputs.py)."""

    def __init__(self, rows: int, width: int, key: str, encoder: DeferredEncoder, bidirectional: bool = False) -> None:
        if rows < 1 or width < 1:
            raise ValueError(f"a deferred embedding needs rows and width >= 1, got {rows} x {width}")
        self._bind(rows, width, key, bidirectional)
        self._vectors = None
        self.encoder = encoder

    def fill(self, vectors: torch.Tensor) -> None:
        """The vectors the encoder computed: [rows, width]."""
        if tuple(vectors.shape) != (self.rows, self.width):
            raise ValueError(f"embedding {self.key!r} takes [{self.rows}, {self.width}] vectors, "
                             f"got {tuple(vectors.shape)}")
        self._vectors = vectors


Span = tuple[int, int]


def bidirectional_spans(input_ids: Sequence[int], embeddings: Sequence[Embedding]) -> tuple[Span, ...]:
    """The [start, end) position runs of input_ids held by bidirectional embeddings' ids. Adjacent
    runs merge into one, as transformers' get_block_sequence_ids_for_mask groups consecutive image
    tokens (Gemma 3's processor always puts text between two images)."""
    ids = {token for embedding in embeddings if embedding.bidirectional for token in embedding.token_ids}
    if not ids:
        return ()
    spans: list[Span] = []
    for position, token in enumerate(input_ids):
        if token not in ids:
            continue
        if spans and spans[-1][1] == position:
            spans[-1] = (spans[-1][0], position + 1)
        else:
            spans.append((position, position + 1))
    return tuple(spans)


def span_containing(spans: Sequence[Span], position: int) -> Span | None:
    """The span with start < position < end (a cut at position would split it), else None."""
    return next((span for span in spans if span[0] < position < span[1]), None)
