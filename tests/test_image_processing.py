"""Image preprocessing against transformers' own image processors (their Pillow backend, built from
config dicts), on generated images of odd sizes, every decodable mode and three file formats; and the
refusals of bad image files before any pixel work."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageOps
from transformers.image_utils import load_image
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from engine.vision.processing import image_processor_from_config
from image_input import ImageLimits, decode_base64_image, decode_image

# The fields of real preprocessor_config.json files (gemma-3-4b-it, siglip-so400m, llava-1.5-7b-hf).
GEMMA3_CONFIG: dict[str, Any] = {
    "image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": None, "do_normalize": True,
    "do_pan_and_scan": None, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "resample": 2, "rescale_factor": 0.00392156862745098,
    "size": {"height": 96, "width": 96},
}
SIGLIP_CONFIG: dict[str, Any] = {
    "image_processor_type": "SiglipImageProcessor", "do_normalize": True, "do_rescale": True,
    "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
    "rescale_factor": 0.00392156862745098, "size": {"height": 64, "width": 80},
}
CLIP_CONFIG: dict[str, Any] = {
    "image_processor_type": "CLIPImageProcessor", "crop_size": {"height": 56, "width": 56},
    "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
    "do_resize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3,
    "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 56},
}
REFERENCES = {"Gemma3ImageProcessor": Gemma3ImageProcessorPil, "SiglipImageProcessor": SiglipImageProcessorPil,
              "CLIPImageProcessor": CLIPImageProcessorPil}
CONFIGS = {"gemma3": GEMMA3_CONFIG, "siglip": SIGLIP_CONFIG, "clip": CLIP_CONFIG}
SIZES = [(17, 33), (640, 481), (1, 1), (4000, 3), (3, 4000)]
# (mode, formats that store it)
MODES = [("RGB", ["PNG", "JPEG", "WEBP"]), ("RGBA", ["PNG", "WEBP"]), ("L", ["PNG", "JPEG"]),
         ("LA", ["PNG"]), ("P", ["PNG"]), ("CMYK", ["JPEG"]), ("1", ["PNG"])]


def reference(config: dict[str, Any], image: Image.Image) -> np.ndarray:
    kwargs = {k: v for k, v in config.items() if k != "image_processor_type" and v is not None}
    processor = REFERENCES[config["image_processor_type"]](**kwargs)
    return np.asarray(processor(image, return_tensors="np")["pixel_values"][0])


def random_image(mode: str, size: tuple[int, int], seed: int) -> Image.Image:
    width, height = size
    rng = np.random.default_rng(seed)
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "P":
        return rgba.convert("RGB").quantize(colors=64)
    return rgba.convert(mode)


def file_bytes(image: Image.Image, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}), **options)
    return out.getvalue()


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode,formats", MODES, ids=[m for m, _ in MODES])
def test_pixels_equal_transformers(config_name: str, size: tuple[int, int], mode: str, formats: list[str]) -> None:
    config = CONFIGS[config_name]
    processor = image_processor_from_config(config)
    for fmt in formats:
        data = file_bytes(random_image(mode, size, seed=size[0] * 7 + size[1]), fmt)
        ours = processor.preprocess(data)
        theirs = reference(config, Image.open(io.BytesIO(data)))
        assert ours.dtype == np.float32 and ours.shape == theirs.shape, (fmt, ours.shape, theirs.shape)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6, err_msg=fmt)


def test_palette_transparency_is_composited_onto_white() -> None:
    """A P image with a transparent palette entry goes through transformers' alpha path, not a plain convert."""
    image = random_image("P", (31, 29), seed=3)
    data = file_bytes(image, "PNG", transparency=0)
    assert Image.open(io.BytesIO(data)).info.get("transparency") is not None
    ours = image_processor_from_config(SIGLIP_CONFIG).preprocess(data)
    np.testing.assert_allclose(ours, reference(SIGLIP_CONFIG, Image.open(io.BytesIO(data))), rtol=0, atol=1e-6)


def test_exif_orientation_is_applied_as_load_image_does() -> None:
    """A JPEG saved sideways with an EXIF orientation tag comes out upright, as transformers' load_image gives it."""
    image = random_image("RGB", (40, 23), seed=5)
    exif = Image.Exif()
    exif[0x0112] = 6
    data = file_bytes(image, "JPEG", exif=exif)
    upright = load_image(base64.b64encode(data).decode())
    assert upright.size == (23, 40)
    ours = image_processor_from_config(CLIP_CONFIG).preprocess(data)
    np.testing.assert_allclose(ours, reference(CLIP_CONFIG, upright), rtol=0, atol=1e-6)
    assert decode_image(data).size == ImageOps.exif_transpose(Image.open(io.BytesIO(data))).size


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_claiming(width: int, height: int) -> bytes:
    """A well-formed PNG whose header claims an 8-bit RGB width x height canvas, with one row of pixel data."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    data = png_chunk(b"IDAT", zlib.compress(b"\x00" * (1 + 3 * min(width, 1000))))
    return b"\x89PNG\r\n\x1a\n" + header + data + png_chunk(b"IEND", b"")


@pytest.mark.parametrize("data,limits,message", [
    (b"this is not an image at all", ImageLimits(), "not an image"),
    (file_bytes(random_image("RGB", (64, 64), seed=1), "PNG")[:300], ImageLimits(), "truncated"),
    (png_claiming(100_000, 100_000), ImageLimits(), "decompression bomb.*max_pixels"),
    (png_claiming(5_000, 5_000), ImageLimits(max_pixels=1_000_000), "max_pixels=1000000"),
    (file_bytes(random_image("RGB", (64, 64), seed=1), "PNG"), ImageLimits(max_bytes=1000), "max_bytes=1000"),
    (file_bytes(Image.fromarray(np.full((4, 4), 60000, dtype=np.uint16)), "PNG"), ImageLimits(), "mode I;16"),
], ids=["garbage", "truncated-png", "bomb-header", "over-max-pixels", "over-max-bytes", "16-bit"])
def test_bad_image_files_are_refused(data: bytes, limits: ImageLimits, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_image(data, limits)


GOOD_PNG = file_bytes(random_image("RGB", (16, 12), seed=3), "PNG")


@pytest.mark.parametrize("text,limits,message", [
    ("data:image/png;base64," + base64.b64encode(GOOD_PNG).decode(), ImageLimits(), "data: URL prefix"),
    ("", ImageLimits(), "empty"),
    ("aGVsbG8*d29ybGQ=", ImageLimits(), "'\\*' at position 7 is not in the base64 alphabet"),
    ("aGVs=bG8=", ImageLimits(), "'=' padding may only end it"),
    ("aGVsbG8gd", ImageLimits(), "one character over"),
    (base64.urlsafe_b64encode(b"\xfb\xff" * 30).decode(), ImageLimits(), "'-' at position"),
    (base64.b64encode(GOOD_PNG).decode(), ImageLimits(max_bytes=100), "max_bytes=100"),
    (base64.b64encode(b"not an image").decode(), ImageLimits(), "not an image"),
    (base64.b64encode(png_claiming(100_000, 100_000)).decode(), ImageLimits(), "decompression bomb"),
], ids=["data-url", "empty", "alphabet", "inner-padding", "truncated", "urlsafe", "over-max-bytes", "not-image",
        "bomb"])
def test_bad_base64_images_are_refused_naming_the_problem(text: str, limits: ImageLimits, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_base64_image(text, limits)


def test_base64_images_decode_padded_unpadded_and_wrapped() -> None:
    text = base64.b64encode(GOOD_PNG).decode()
    wrapped = "\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    for variant in (text, text.rstrip("="), wrapped):
        assert decode_base64_image(variant).size == (16, 12)


@pytest.mark.parametrize("change,field", [
    ({"image_processor_type": "Qwen2VLImageProcessor"}, "image_processor_type"),
    ({"do_pan_and_scan": True}, "do_pan_and_scan"),
    ({"resample": 9}, "resample"),
    ({"size": {"shortest_edge": 10}}, "size"),
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
])
def test_unsupported_configs_are_refused(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        image_processor_from_config({**GEMMA3_CONFIG, **change})
