"""ImageEncoder: decoded images of several jobs -> keyed Embeddings, the tower run once per distinct image.

A service prepares a job's images where it builds the job (`prepare`: preprocessing and the content key,
off the engine loop) and the generator encodes them when it admits the job (`encode_deferred`: every
deferred image of a step's admissions in one tower call, an image whose vectors a live job already holds
taken from it), as vLLM v1 schedules encoder inputs with the step. `encode` runs the tower at once.

Each image is preprocessed as the model's Hugging Face processor does (engine/vision/processing.py), then
named by a content key: sha256 of its pixel values and the encoder's identity. Images with equal keys are
encoded once, in one batch with every other distinct image of the call, on the tower's device and dtype,
and get Embeddings with that key, so equal images take equal reserved ids (engine/embeddings.py): jobs
with the same image share the prompt pages after it, different images never do.

expand_image_placeholders turns a prompt's image tokens into the embeddings' reserved ids: LLaVA's one per
image (as the chat template writes `<image>`; LlavaProcessor expands it into tokens_per_image tokens), Gemma 3's
run of tokens_per_image soft tokens per image. ImagePrompt says how a model's prompt text marks an image and
expands it: Gemma3Processor replaces each `<start_of_image>` in the text with
"\n\n<start_of_image>" + tokens_per_image x `<image_soft_token>` + "<end_of_image>\n\n" and tokenizes the
result, so the newlines merge with the prompt's own as its tokenizer merges them; ImagePrompt does the same.
Gemma 3's embeddings are bidirectional (engine/embeddings.py): an image's positions attend to each other.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from engine.embeddings import DeferredEmbedding, Embedding
from engine.errors import ModelLoadError
from engine.tokenizer import Tokenizer
from engine.vision.loading import load_vision_tower
from engine.vision.processing import ImageProcessor, image_processor_from_config
from engine.vision.tower import VisionTower

_encoders = itertools.count()


class PendingImage(DeferredEmbedding):
    """One image's preprocessed pixels and content key, its vectors to come from `encoder`'s tower."""

    def __init__(self, pixels: np.ndarray, key: str, encoder: ImageEncoder) -> None:
        super().__init__(encoder.tokens_per_image, encoder.tower.config.text_hidden_size, key, encoder,
                         bidirectional=encoder.tower.config.bidirectional_images)
        self.pixels: np.ndarray | None = pixels

    def fill(self, vectors: torch.Tensor) -> None:
        super().fill(vectors)
        self.pixels = None  # the tower has seen them; a preempted job recomputes from the vectors


class ImageEncoder:
    """A loaded VisionTower with its model's image processor. `identity` goes into every content key: by
    default unique to this encoder in the process (another tower's rows never share ids with this one's)."""

    def __init__(self, tower: VisionTower, processor: ImageProcessor, identity: str | None = None) -> None:
        self.tower, self.processor = tower, processor
        self.identity = identity or f"{tower.config.architecture}#{next(_encoders)}"
        parameter = next(tower.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.tower_batches = 0  # forward calls of the tower
        self.images_encoded = 0  # distinct images those calls encoded
        # the encoder cache: key -> the vectors of an image some live job holds
        self._cached: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | str | None = None) -> ImageEncoder:
        """The tower, projector and image processor of a LLaVA or Gemma 3 HF directory."""
        path = Path(path)
        processor_path = path / "preprocessor_config.json"
        if not processor_path.is_file():
            raise ModelLoadError(f"{processor_path} not found: a vision-language directory needs its image "
                                 "processor's config to take images")
        try:
            processor = image_processor_from_config(json.loads(processor_path.read_text()))
        except ValueError as error:
            raise ModelLoadError(f"{processor_path}: {error}") from error
        return cls(load_vision_tower(path, device, dtype), processor)

    @property
    def image_token_id(self) -> int:
        """The token a prompt holds where an image goes (before expand_image_placeholders)."""
        return self.tower.config.image_token_id

    @property
    def tokens_per_image(self) -> int:
        return self.tower.tokens_per_image

    def key(self, pixels: np.ndarray) -> str:
        """The content key of one image's preprocessed pixels under this encoder."""
        pixels = np.ascontiguousarray(pixels)
        digest = hashlib.sha256()
        digest.update(f"{self.identity}|{pixels.dtype.str}|{pixels.shape}|".encode())
        digest.update(pixels.data)
        return f"image:{digest.hexdigest()}"

    def prepare(self, images: Sequence[Image.Image]) -> list[PendingImage]:
        """One job's images, preprocessed and keyed, in order: the job's embeddings before the tower runs
        (their ids are known, so the prompt can be expanded and the job admitted)."""
        prepared = []
        for image in images:
            pixels = self.processor.pixels(image)
            prepared.append(PendingImage(pixels, self.key(pixels), self))
        return prepared

    def encode(self, images: Sequence[Sequence[Image.Image]]) -> list[list[Embedding]]:
        """Per job, per image: its Embedding ([tokens_per_image, text hidden size] on the tower's device).
        The tower runs once, over the distinct images of all the jobs together."""
        keyed: list[list[str]] = []
        distinct: dict[str, np.ndarray] = {}
        for job_images in images:
            keys = []
            for image in job_images:
                pixels = self.processor.pixels(image)
                key = self.key(pixels)
                distinct.setdefault(key, pixels)
                keys.append(key)
            keyed.append(keys)
        if not distinct:
            return [[] for _ in keyed]
        both_ways = self.tower.config.bidirectional_images
        by_key = {key: Embedding(rows, key=key, bidirectional=both_ways)
                  for key, rows in self._run_tower(distinct).items()}
        return [[by_key[key] for key in keys] for keys in keyed]

    def encode_deferred(self, embeddings: Sequence[DeferredEmbedding]) -> None:
        """Fill the vectors of PendingImages (of this encoder): those a live job already holds from the
        encoder cache, the rest in one tower call over their distinct images."""
        vectors: dict[str, torch.Tensor] = {}
        distinct: dict[str, np.ndarray] = {}
        for embedding in embeddings:
            if not isinstance(embedding, PendingImage) or embedding.encoder is not self:
                raise ValueError(f"embedding {embedding.key!r} is not an image this encoder prepared")
            key = embedding.key
            assert key is not None, "a PendingImage has its content key"
            cached = self._cached.get(key)
            if cached is not None:
                vectors[key] = cached
            elif embedding.pixels is not None:
                distinct.setdefault(key, embedding.pixels)
        if distinct:
            vectors |= self._run_tower(distinct)
        for embedding in embeddings:
            if not embedding.encoded:
                assert embedding.key is not None
                embedding.fill(vectors[embedding.key])
                self._cached[embedding.key] = vectors[embedding.key]

    def _run_tower(self, pixels: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """One tower forward over the images: key -> its rows."""
        batch = torch.from_numpy(np.stack(list(pixels.values()))).to(self.device, self.dtype)
        features = self.tower(batch)
        self.tower_batches += 1
        self.images_encoded += len(pixels)
        return dict(zip(pixels, features, strict=True))

    def image_prompt(self, tokenizer: Tokenizer) -> ImagePrompt | None:
        """How prompts for this model mark and expand images, in the tokenizer's text; None when a token
        it needs has no text."""
        config = self.tower.config
        placeholder = tokenizer.id_to_token(config.placeholder_token_id)
        if not placeholder:
            return None
        if config.projector != "gemma3":
            return ImagePrompt(placeholder, config.placeholder_token_id, config.image_token_id, 1, placeholder)
        soft, end = tokenizer.id_to_token(config.image_token_id), tokenizer.id_to_token(config.eoi_token_id)
        if not soft or not end:
            return None
        sequence = f"\n\n{placeholder}{soft * config.tokens_per_image}{end}\n\n"
        return ImagePrompt(placeholder, config.placeholder_token_id, config.image_token_id, config.tokens_per_image,
                           sequence)


@dataclass(frozen=True)
class ImagePrompt:
    """A model's image marks: `placeholder` (token placeholder_token_id) in a prompt's text stands for one
    image, and becomes `sequence` (the HF processor's expansion, holding tokens_each image tokens) before
    tokenizing."""

    placeholder: str
    placeholder_token_id: int
    image_token_id: int
    tokens_each: int
    sequence: str

    def expand_text(self, text: str) -> str:
        """The text as the HF processor has it before tokenizing (LLaVA's is unchanged)."""
        return text if self.sequence == self.placeholder else text.replace(self.placeholder, self.sequence)

    def place(self, input_ids: Sequence[int], embeddings: Sequence[Embedding]) -> list[int]:
        """Token ids of an expanded prompt -> the embeddings' ids in place of each image's tokens
        (ValueError when the counts differ)."""
        return expand_image_placeholders(input_ids, embeddings, self.image_token_id, self.tokens_each)

    def expand_tokens(self, input_ids: Sequence[int], tokenizer: Tokenizer) -> list[int]:
        """Token ids whose images are marked by the placeholder token (a request's input_ids) with each
        placeholder expanded into the sequence's tokens, token by token as vLLM expands a token prompt
        (newlines next to it are not merged)."""
        if self.tokens_each == 1:
            return list(input_ids)
        sequence = tokenizer.encode(self.sequence, add_special_tokens=False)
        return [t for token in input_ids for t in (sequence if token == self.placeholder_token_id else [token])]


def expand_image_placeholders(input_ids: Sequence[int], embeddings: Sequence[Embedding],
                              image_token_id: int, tokens_each: int = 1) -> list[int]:
    """input_ids with its i-th run of tokens_each image tokens replaced by embeddings[i].token_ids (LLaVA:
    one image token per image, as the chat template writes `<image>`; Gemma 3: the processor's
    tokens_per_image soft tokens). ValueError when the counts differ."""
    positions = [i for i, token in enumerate(input_ids) if token == image_token_id]
    runs = [positions[i : i + tokens_each] for i in range(0, len(positions), tokens_each)]
    if len(positions) != tokens_each * len(embeddings) or any(run[-1] - run[0] != tokens_each - 1 for run in runs):
        each = "exactly one" if tokens_each == 1 else f"one run of {tokens_each}"
        raise ValueError(f"the prompt has {len(positions)} image tokens (id {image_token_id}) for "
                         f"{len(embeddings)} images: each image needs {each}")
    expanded: list[int] = []
    start = 0
    for run, embedding in zip(runs, embeddings, strict=True):
        expanded += input_ids[start : run[0]]
        expanded += embedding.token_ids
        start = run[-1] + 1
    expanded += input_ids[start:]
    return expanded
