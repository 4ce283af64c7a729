"""A request's images on the worker: what the card says about them, the refusals before any pixel
work, and the one hand-off to the vision side.

- `image_support`: the card's `images` (producer/model_card.py) from the vision encoder the
  generator loaded (engine/vision/: LLaVA's and Gemma 3's): the placeholder a `prompt` marks an
  image with, the tokens one image becomes, how many images a request may carry.
- `decode_images`: every image the request carries, decoded with image_input/ within the
  protocol's limits (MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS), after the checks that need no decoding (a
  model that takes no images, too many images, a prompt whose placeholders do not match). Each
  refusal is a ProtocolError naming the image's field path, so malformed base64, a decompression
  bomb or a file that is not an image never reaches the vision tower.
- `prepare_images`: decoded images -> the job's embeddings before the tower ran, from the
  generator's ImageEncoder (engine/vision/images.py: preprocessed and keyed by content on the task's
  thread, so equal images share prompt pages); the engine runs the tower when it admits the job, over
  the images of every job admitted in that step together (engine/encoder_inputs.py). Gemma 3's
  embeddings attend to each other both ways (engine/embeddings.py); build_job expands the prompt as
  Gemma3Processor does (ImagePrompt).
"""

from __future__ import annotations

import logging

from PIL import Image

from engine import Embedding, Generator
from image_input import ImageLimits, decode_base64_image
from producer.model_card import ImageSupport
from producer.protocol import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_IMAGES, GenerationRequest, ProtocolError

log = logging.getLogger(__name__)

IMAGE_LIMITS = ImageLimits(max_bytes=MAX_IMAGE_BYTES, max_pixels=MAX_IMAGE_PIXELS)


def image_support(generator: Generator) -> ImageSupport | None:
    """The card's `images` for the generator's model, from the vision encoder it loaded; None when it
    takes none (a text model, a GGUF file without its mmproj, a vision directory that loaded text only). An image costs
    the tokens its placeholder becomes: Gemma 3's soft tokens with the newlines and <end_of_image>
    its processor adds (at most: newlines may merge with the prompt's)."""
    if generator.vision is None:
        return None
    prompt = generator.vision.image_prompt(generator.tokenizer)
    if prompt is None:
        log.warning("the model's image tokens have no text: the card says it takes no images")
        return None
    # the expanded placeholder's tokens, each image token then standing for its share of the image's rows
    rows = generator.vision.tokens_per_image
    tokens = len(generator.tokenizer.encode(prompt.sequence, add_special_tokens=False)) - prompt.tokens_each + rows
    fit = generator.max_seq_len // tokens
    return ImageSupport(placeholder=prompt.placeholder, tokens_per_image=tokens, max_images=min(MAX_IMAGES, fit))


def decode_images(request: GenerationRequest, support: ImageSupport | None) -> list[Image.Image]:
    """The request's images, decoded in prompt order; ProtocolError naming every problem."""
    inputs = request.image_inputs()
    if not inputs:
        return []
    if support is None:
        raise ProtocolError([f"{path}: this worker's model takes no images" for path, _ in inputs])
    if len(inputs) > support.max_images:
        field = "images" if request.images else "messages"
        raise ProtocolError([f"{field}: this worker's model takes at most {support.max_images} images per request "
                             f"({support.tokens_per_image} tokens each), got {len(inputs)}"])
    problems = []
    if request.prompt is not None:
        marks = request.prompt.count(support.placeholder)
        if marks != len(inputs):
            problems.append(f"prompt: holds the image placeholder {support.placeholder!r} {marks} time(s) for "
                            f"{len(inputs)} image(s); put it once where each image goes")
    decoded = []
    for path, image in inputs:
        try:
            decoded.append(decode_base64_image(image.data, IMAGE_LIMITS))
        except ValueError as error:
            problems.append(f"{path}: {error}")
    if problems:
        raise ProtocolError(problems)
    return decoded


def prepare_images(decoded: list[Image.Image], generator: Generator) -> list[Embedding]:
    """The decoded images' embeddings, in prompt order, for build_job to place; the engine fills their
    vectors when it admits the job."""
    encoder = generator.vision
    assert encoder is not None, "decode_images refuses images for a model that takes none"
    return list(encoder.prepare(decoded))
