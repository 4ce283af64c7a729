"""VisionTower: pixel values -> the rows that replace a prompt's image tokens, what transformers'
`get_image_features(pixel_values)` returns for LLaVA and Gemma 3.

LLaVA reads one (or several, concatenated) intermediate encoder layers, drops CLIP's class token under
the "default" select strategy, and projects with its MLP; Gemma 3 reads SigLIP's normed last layer and
pools it. Images in a batch never see each other: the encoder attends within an image only.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.vision.config import VisionLanguageConfig
from engine.vision.encoder import VisionEncoder
from engine.vision.projectors import Gemma3Projector, LlavaProjector


class VisionTower(nn.Module):
    """forward(pixels [B, C, H, W]) -> image features [B, tokens_per_image, text_hidden_size]."""

    def __init__(self, config: VisionLanguageConfig) -> None:
        super().__init__()
        self.config = config
        gemma = config.projector == "gemma3"
        self.vision = VisionEncoder(config.encoder, config.layers_needed, post_layernorm=gemma)
        self.projector: nn.Module = Gemma3Projector(config) if gemma else LlavaProjector(config)
        total = config.encoder.num_layers + 1
        # indices into the encoder's hidden states: Gemma 3 reads the last; LLaVA its feature layers
        self.keep = [config.layers_needed] if gemma else [i % total for i in config.feature_layers]

    @property
    def tokens_per_image(self) -> int:
        return self.config.tokens_per_image

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        states = self.vision(pixel_values, sorted(set(self.keep)))
        by_index = dict(zip(sorted(set(self.keep)), states, strict=True))
        selected = [by_index[i] for i in self.keep]
        if self.config.drop_first_token:
            selected = [s[:, 1:] for s in selected]
        features = selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
        return self.projector(features)
