"""Image preprocessing equal to Hugging Face's image processors (their Pillow/numpy backend), without torch.

Two recipes, read from a model's preprocessor_config.json:
  - "siglip" (SiglipImageProcessor, Gemma3ImageProcessor without pan-and-scan): resize to height x width;
  - "clip" (CLIPImageProcessor, as LLaVA-1.5 uses it): resize the shortest edge, then center-crop.
Both then rescale and normalize, and return float32 pixels channels-first (3, H, W). Each step does the
same arithmetic in the same dtypes as transformers so the pixels agree to the last bit.
"""
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from image_input import DEFAULT_LIMITS, ImageLimits, decode_image

# Pillow's resampling filters by the integer transformers stores in "resample".
RESAMPLE_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}

SIGLIP_TYPES = frozenset({"SiglipImageProcessor", "SiglipImageProcessorFast", "Gemma3ImageProcessor",
                          "Gemma3ImageProcessorFast"})
CLIP_TYPES = frozenset({"CLIPImageProcessor", "CLIPImageProcessorFast"})

IMAGENET_STANDARD = (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessor:
    """One recipe with its numbers: `resize_to` (height, width) for SigLIP, `shortest_edge` then `crop_to`
    for CLIP; None skips a step."""
    resize_to: tuple[int, int] | None
    shortest_edge: int | None
    crop_to: tuple[int, int] | None
    resample: int
    rescale_factor: float | None
    image_mean: tuple[float, float, float] | None
    image_std: tuple[float, float, float] | None

    def preprocess(self, data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
        """float32 pixels (3, H, W) of the image file in `data`."""
        return self.pixels(decode_image(data, limits))

    def pixels(self, image: Image.Image) -> np.ndarray:
        """float32 pixels (3, H, W) of a decoded image."""
        rgb = to_rgb(image)
        if self.resize_to is not None:
            rgb = resize(rgb, self.resize_to, self.resample)
        elif self.shortest_edge is not None:
            rgb = resize(rgb, shortest_edge_size(rgb.size, self.shortest_edge), self.resample)
        array = np.moveaxis(np.asarray(rgb), -1, 0)
        if self.crop_to is not None:
            array = center_crop(array, self.crop_to)
        values = array.astype(np.float32)
        if self.rescale_factor is not None:
            values = (array.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.image_mean is not None and self.image_std is not None:
            mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.array(self.image_std, dtype=np.float32)[:, None, None]
            values = (values - mean) / std
        return values


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB; transparency is composited onto white, as transformers' convert_to_rgb does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def resize(image: Image.Image, size: tuple[int, int], resample: int) -> Image.Image:
    height, width = size
    return image.resize((width, height), resample=Image.Resampling(resample))


def shortest_edge_size(image_size: tuple[int, int], edge: int) -> tuple[int, int]:
    """(height, width) with the shorter side `edge`, the longer one scaled and truncated (torchvision's rule)."""
    width, height = image_size
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(edge * long / short)
    return (new_long, edge) if width <= height else (edge, new_long)


def center_crop(array: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The centre (height, width) of a (C, H, W) array, zero-padded where the image is smaller."""
    crop_height, crop_width = size
    channels, height, width = array.shape
    padded_height, padded_width = max(crop_height, height), max(crop_width, width)
    top_pad, left_pad = -(-(padded_height - height) // 2), -(-(padded_width - width) // 2)
    padded = np.zeros((channels, padded_height, padded_width), dtype=array.dtype)
    padded[:, top_pad:top_pad + height, left_pad:left_pad + width] = array
    top = (height - crop_height) // 2 + top_pad
    left = (width - crop_width) // 2 + left_pad
    return padded[:, max(0, top):top + crop_height, max(0, left):left + crop_width]


def image_processor_from_config(config: dict[str, Any]) -> ImageProcessor:
    """The processor a preprocessor_config.json describes; refuses what it cannot reproduce, naming the field."""
    kind = config.get("image_processor_type")
    if kind in SIGLIP_TYPES:
        return _siglip(config, str(kind))
    if kind in CLIP_TYPES:
        return _clip(config)
    raise ValueError(f"image_processor_type {kind!r} is not supported (supported: "
                     f"{', '.join(sorted(SIGLIP_TYPES | CLIP_TYPES))})")


def _siglip(config: dict[str, Any], kind: str) -> ImageProcessor:
    if config.get("do_pan_and_scan"):
        raise ValueError("do_pan_and_scan=true is not supported yet")
    gemma = kind.startswith("Gemma3")
    size = _size(config, "size", {"height": 224, "width": 224})
    if "height" not in size or "width" not in size:
        raise ValueError(f"size must have height and width for {kind}, got {size}")
    return ImageProcessor(
        resize_to=(size["height"], size["width"]) if _flag(config, "do_resize") else None,
        shortest_edge=None, crop_to=None,
        resample=_resample(config, 2 if gemma else 3),
        **_rescale_and_normalize(config, IMAGENET_STANDARD, IMAGENET_STANDARD))


def _clip(config: dict[str, Any]) -> ImageProcessor:
    size = _size(config, "size", {"shortest_edge": 224})
    if "shortest_edge" not in size:
        raise ValueError(f"size must have shortest_edge for CLIPImageProcessor, got {size}")
    crop = _size(config, "crop_size", {"height": 224, "width": 224})
    if "height" not in crop or "width" not in crop:
        raise ValueError(f"crop_size must have height and width, got {crop}")
    return ImageProcessor(
        resize_to=None,
        shortest_edge=size["shortest_edge"] if _flag(config, "do_resize") else None,
        crop_to=(crop["height"], crop["width"]) if _flag(config, "do_center_crop") else None,
        resample=_resample(config, 3),
        **_rescale_and_normalize(config, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))


def _flag(config: dict[str, Any], name: str) -> bool:
    """A do_* switch; transformers reads null as the class default, which is on for every switch used here."""
    value = config.get(name)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true, false or null, got {value!r}")
    return value


def _size(config: dict[str, Any], name: str, default: dict[str, int]) -> dict[str, int]:
    value = config.get(name)
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        return {"height": value, "width": value} if name == "crop_size" else {"shortest_edge": value}
    if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                              for v in value.values()):
        raise ValueError(f"{name} must be a positive integer or a dict of positive integers, got {value!r}")
    return value


def _resample(config: dict[str, Any], default: int) -> int:
    value = config.get("resample", default)
    if value is None:
        return default
    if value not in RESAMPLE_FILTERS or isinstance(value, bool):
        names = ", ".join(RESAMPLE_FILTERS.values())
        raise ValueError(f"resample must be one of {sorted(RESAMPLE_FILTERS)} ({names}), got {value!r}")
    return int(value)


def _rescale_and_normalize(config: dict[str, Any], mean: tuple[float, float, float],
                           std: tuple[float, float, float]) -> dict[str, Any]:
    factor = config.get("rescale_factor")
    factor = 1 / 255 if factor is None else factor
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ValueError(f"rescale_factor must be a positive number, got {factor!r}")
    normalize = _flag(config, "do_normalize")
    return {
        "rescale_factor": float(factor) if _flag(config, "do_rescale") else None,
        "image_mean": _triple(config, "image_mean", mean) if normalize else None,
        "image_std": _triple(config, "image_std", std) if normalize else None,
    }


def _triple(config: dict[str, Any], name: str, default: tuple[float, float, float]) -> tuple[float, float, float]:
    value = config.get(name)
    if value is None:
        return default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * 3
    if (not isinstance(value, list) or len(value) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise ValueError(f"{name} must be a number or a list of 3 numbers, got {value!r}")
    return (float(value[0]), float(value[1]), float(value[2]))
