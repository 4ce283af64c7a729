"""Decodes an image file's bytes with Pillow, refusing bad input before any pixel is decoded.

Limits are checked on what the header claims (byte count, then width x height) so that a small
file claiming a huge canvas (a decompression bomb) costs nothing to refuse.
"""
import io
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

# Modes Pillow converts to 8-bit RGB faithfully. 16- and 32-bit integer and float modes ("I;16",
# "I", "F") are not among them: Pillow's RGB conversion (which transformers uses) clips them to 255.
SUPPORTED_MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "YCbCr"})


@dataclass(frozen=True)
class ImageLimits:
    """What one image may cost to decode."""
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {self.max_bytes}")
        # Pillow refuses more than twice its own limit inside Image.open, before we could look.
        pillow_limit = Image.MAX_IMAGE_PIXELS
        if self.max_pixels < 1 or (pillow_limit is not None and self.max_pixels > pillow_limit):
            raise ValueError(f"max_pixels must be in [1, {pillow_limit}] (Pillow's own limit), "
                             f"got {self.max_pixels}")


DEFAULT_LIMITS = ImageLimits()


def decode_image(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """The image in `data` (PNG, JPEG, WebP, ... as Pillow reads them), loaded and turned upright by its
    EXIF orientation as transformers' load_image does; the first frame of an animation."""
    if len(data) > limits.max_bytes:
        raise ValueError(f"image is {len(data)} bytes, more than max_bytes={limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as error:
        raise ValueError(f"image is a decompression bomb: its header claims more than "
                         f"max_pixels={limits.max_pixels} pixels ({error})") from error
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as error:
        raise ValueError(f"data is not an image file Pillow can read: {error}") from error
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ValueError(f"image is {width}x{height} = {width * height} pixels, more than "
                         f"max_pixels={limits.max_pixels}")
    if width < 1 or height < 1:
        raise ValueError(f"image has an empty canvas ({width}x{height})")
    if image.mode not in SUPPORTED_MODES:
        raise ValueError(f"image mode {image.mode} is not supported (supported: {', '.join(sorted(SUPPORTED_MODES))}); "
                         "16- and 32-bit images would be clipped to 255 by the RGB conversion")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        raise ValueError(f"image data is malformed or truncated: {error}") from error
    return ImageOps.exif_transpose(image)
