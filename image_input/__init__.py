"""Images as the service receives them: base64 or file bytes decoded with Pillow, refusing bad input
(malformed base64, too many bytes, not an image, a decompression bomb by its header, truncated data,
16/32-bit modes) before any pixel work. A floor both sides import: the gateway checks a request's
images before queueing it, the worker before they reach the vision tower. Pillow and the standard
library only: it imports none of genq's packages, nor torch."""

from image_input.image_file import (
    DEFAULT_LIMITS,
    SUPPORTED_MODES,
    ImageLimits,
    base64_decoded_size,
    decode_base64_image,
    decode_image,
)

__all__ = ["DEFAULT_LIMITS", "SUPPORTED_MODES", "ImageLimits", "base64_decoded_size", "decode_base64_image",
           "decode_image"]
