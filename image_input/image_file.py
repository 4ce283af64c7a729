"""Decodes an image file's bytes with Pillow, refusing bad input before any pixel is decoded.

Limits are checked on what the header claims (byte count, then width x height) so that a small
file claiming a huge canvas (a decompression bomb) costs nothing to refuse.
"""
import binascii
import io
import re
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

# Standard base64 (RFC 4648 section 4), padded or not; URL-safe "-" and "_" are not accepted.
_BASE64_RE = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_WHITESPACE = re.compile(r"\s+")


def base64_decoded_size(text: str) -> int:
    """The bytes `text` decodes to if it is well-formed base64 (padding and whitespace not counted)."""
    length = len(text) - text.count("=")
    return length * 3 // 4


def decode_base64_image(text: str, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """decode_image of base64 text (standard alphabet; padding optional; line breaks allowed, as MIME
    writes them). Malformed base64 is refused, naming what is wrong, before any byte reaches Pillow; so
    is text that would decode to more than max_bytes, before it is decoded."""
    if text.startswith("data:"):
        raise ValueError("base64 data must not carry a data: URL prefix (send what follows 'base64,')")
    if any(c in text for c in " \t\r\n\f\v"):
        text = _WHITESPACE.sub("", text)
    if not text:
        raise ValueError("base64 data is empty")
    size = base64_decoded_size(text)
    if size > limits.max_bytes:
        raise ValueError(f"image is {size} bytes (decoded), more than max_bytes={limits.max_bytes}")
    if not _BASE64_RE.fullmatch(text):
        bad = next((i for i, c in enumerate(text) if not (c.isascii() and (c.isalnum() or c in "+/="))), None)
        where = (f"the character {text[bad]!r} at position {bad} is not in the base64 alphabet" if bad is not None
                 else "'=' padding may only end it")
        raise ValueError(f"base64 data is malformed: {where}")
    if len(text.rstrip("=")) % 4 == 1:
        raise ValueError(f"base64 data is malformed: its length without padding ({len(text.rstrip('='))}) "
                         "leaves one character over (a truncated string)")
    padded = text.rstrip("=") + "=" * (-len(text.rstrip("=")) % 4)
    try:
        data = binascii.a2b_base64(padded, strict_mode=True)
    except binascii.Error as error:
        raise ValueError(f"base64 data is malformed: {error}") from None
    return decode_image(data, limits)


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
