"""Tensor names in vision-language checkpoints, in each spelling transformers has saved them.

transformers >= 4.52 nests everything under `model.` (`model.language_model.layers...`,
`model.vision_tower.vision_model...`, `model.multi_modal_projector...`, `lm_head`); released checkpoints
(llava-hf, google/gemma-3) and transformers 5's save_pretrained, which converts back to that layout, write
`language_model.model...`, `language_model.lm_head`, `vision_tower[.vision_model]...`,
`multi_modal_projector...`. Both map onto one naming: a text checkpoint's for the language model, and
`vision.` / `projector.` for VisionTower's parameters.
"""

from __future__ import annotations

_LANGUAGE = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION = (
    ("model.vision_tower.vision_model.", "vision."),
    ("vision_tower.vision_model.", "vision."),
    ("model.vision_tower.", "vision."),
    ("vision_tower.", "vision."),
    ("model.multi_modal_projector.", "projector."),
    ("multi_modal_projector.", "projector."),
)


def _renamed(name: str, table: tuple[tuple[str, str], ...]) -> str | None:
    for prefix, ours in table:
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return None


def vision_name(hf_name: str) -> str | None:
    """VisionTower's name for a vision-tower or projector tensor; None for any other tensor."""
    return _renamed(hf_name, _VISION)


def language_model_name(hf_name: str) -> str | None:
    """The text-checkpoint name (`model.layers...`, `lm_head.weight`) of a language-model tensor; None for
    the vision tower's and projector's, which the text model skips; other names unchanged, so that the
    text loader reports them as unexpected."""
    if vision_name(hf_name) is not None:
        return None
    return _renamed(hf_name, _LANGUAGE) or hf_name
