"""OpenAI's `image_url` content parts, turned into the protocol's image parts before anything is
queued (docs/gateway.md, Images).

A chat message's part `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}` becomes
`{"type": "image", "data": <base64>, "media_type": ...}` (producer/protocol.py), at the same index of
the message's content, so a refusal's `param` (`messages[0].content[1]`) names what the client sent:

- a `data:image/...;base64,` URL gives its base64 text as it is;
- an `http(s)` URL is fetched here, by the gateway, never by the worker: through the callbacks' SSRF
  guard (producer/callback_targets.py: http and https only, every address the host resolves to
  public unless GENQ_GATEWAY_IMAGE_URL_ALLOW_PRIVATE_HOSTS, the connection pinned to the address
  checked), without following redirects, within MAX_IMAGE_BYTES and GENQ_GATEWAY_IMAGE_FETCH_TIMEOUT_S;
- `detail` (auto, low, high) is accepted and ignored: the model's image processor decides the
  resolution.

Every image is then decoded with image_input/ (off the event loop, IMAGE_DECODES at once), so a
broken image, a file that is not one, an oversized one or a decompression bomb gets a 400 naming
its part; so do image parts sent to a model whose card says it takes no images, and more images
than the card's max_images. Without a card (no live worker) the images are still checked; the
worker checks them again.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from image_input import ImageLimits, decode_base64_image, decode_image
from producer.callback_targets import CallbackUrlRefused, resolve_target_async
from producer.model_card import ImageSupport
from producer.protocol import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_IMAGES, MEDIA_TYPE_PATTERN, GenerationRequest

__all__ = ["IMAGE_DECODES", "IMAGE_URL_PART_SHAPE", "ImageRefused", "ImageUrlPart", "check_images",
           "image_url_parts", "resolve_images"]

IMAGE_URL_PART_SHAPE: Mapping[str, Any] = {"type": None, "image_url": {"url": None, "detail": None}}
DETAILS = (None, "auto", "low", "high")
IMAGE_DECODES = 2
"""Images decoded at once per gateway process (each may take a few hundred MB while it loads)."""
IMAGE_LIMITS = ImageLimits(max_bytes=MAX_IMAGE_BYTES, max_pixels=MAX_IMAGE_PIXELS)
_DATA_URL_RE = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),", re.ASCII)
_MEDIA_TYPE_RE = re.compile(MEDIA_TYPE_PATTERN)
_decode_limiter: anyio.CapacityLimiter | None = None


class ImageRefused(ValueError):
    """An image part the gateway refuses (400); `param` is its path."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ImageUrlPart:
    """An image_url part of a message: where it is, and its URL."""

    message: int
    part: int
    url: str

    @property
    def path(self) -> str:
        return f"messages[{self.message}].content[{self.part}]"


def image_url_parts(messages: list[Any]) -> list[ImageUrlPart]:
    """The image_url parts of the chat (ChatMessageParam or dicts), in order; ImageRefused for a
    part of the wrong shape."""
    found = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else getattr(message, "content", None)
        for p, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, Mapping) or part.get("type") != "image_url":
                continue
            path = f"messages[{m}].content[{p}]"
            image_url = part.get("image_url")
            if isinstance(image_url, str):  # the older shape some clients still send
                image_url = {"url": image_url}
            if not isinstance(image_url, Mapping) or not isinstance(image_url.get("url"), str):
                raise ImageRefused(path, 'an image part is {"type": "image_url", "image_url": {"url": <data: or '
                                         'http(s) URL>, "detail": "auto" | "low" | "high"}}')
            if image_url.get("detail") not in DETAILS:
                raise ImageRefused(f"{path}.image_url.detail", f"must be auto, low or high, got "
                                                               f"{str(image_url.get('detail'))[:40]!r}")
            found.append(ImageUrlPart(m, p, image_url["url"]))
    return found


async def resolve_images(parts: list[ImageUrlPart], card: ImageSupport | None, have_card: bool, *,
                         allow_private: bool, fetch_timeout_s: float) -> dict[tuple[int, int], dict[str, Any]]:
    """(message, part) -> the protocol's image part, every image fetched and decoded; ImageRefused
    naming the first part refused. `have_card`: a live worker published a card (else `card` None
    says nothing about images)."""
    if not parts:
        return {}
    if have_card and card is None:
        raise ImageRefused(parts[0].path, "this model takes no images (the workers' model card says so); send "
                                          "text only")
    limit = card.max_images if card is not None else MAX_IMAGES
    if len(parts) > limit:
        raise ImageRefused(parts[limit].path, f"at most {limit} images per request "
                                              f"({'the model card' if card is not None else 'MAX_IMAGES'}), got "
                                              f"{len(parts)}")
    resolved: dict[tuple[int, int], dict[str, Any]] = {}
    for part in parts:
        resolved[(part.message, part.part)] = await _resolve(part, allow_private, fetch_timeout_s)
    return resolved


async def check_images(request: GenerationRequest, card: ImageSupport | None, have_card: bool) -> None:
    """The checks of resolve_images for a protocol request (POST /v1/tasks): the card's rules, a
    `prompt`'s placeholders (once per image), and every image decoded; ImageRefused naming the
    first image (or the prompt) refused."""
    inputs = request.image_inputs()
    if not inputs:
        return
    if have_card and card is None:
        raise ImageRefused(inputs[0][0], "this model takes no images (the workers' model card says so)")
    if card is not None:
        if len(inputs) > card.max_images:
            raise ImageRefused(inputs[card.max_images][0], f"at most {card.max_images} images per request (the "
                                                           f"model card), got {len(inputs)}")
        if request.prompt is not None and (marks := request.prompt.count(card.placeholder)) != len(inputs):
            raise ImageRefused("prompt", f"holds the image placeholder {card.placeholder!r} {marks} time(s) for "
                                         f"{len(inputs)} image(s); put it once where each image goes")
    for path, image in inputs:
        await _decode(path, decode_base64_image, image.data)


async def _resolve(part: ImageUrlPart, allow_private: bool, fetch_timeout_s: float) -> dict[str, Any]:
    url = part.url
    if url[:5].lower() == "data:":
        media_type, data = _data_url(part.path, url)
        await _decode(part.path, decode_base64_image, data)
    elif url[:7].lower() == "http://" or url[:8].lower() == "https://":
        raw, media_type = await _fetch(part.path, url, allow_private, fetch_timeout_s)
        await _decode(part.path, decode_image, raw)
        data = base64.b64encode(raw).decode()
    else:
        raise ImageRefused(part.path, f"the image URL must be a data: URL (data:image/png;base64,...) or http(s), "
                                      f"got {url[:40]!r}")
    return {"type": "image", "data": data, **({"media_type": media_type} if media_type else {})}


def _data_url(path: str, url: str) -> tuple[str | None, str]:
    match = _DATA_URL_RE.match(url)
    if match is None:
        raise ImageRefused(path, "a data URL is data:<media type>;base64,<data>; this one has no comma")
    media_type = match["type"].lower() or None
    if media_type is not None and not _MEDIA_TYPE_RE.fullmatch(media_type):
        raise ImageRefused(path, f"the data URL's media type must be image/..., got {media_type[:40]!r}")
    if "base64" not in [param.strip().lower() for param in match["params"].split(";")]:
        raise ImageRefused(path, "the data URL must be base64 (data:image/...;base64,...)")
    return media_type, url[match.end():]


async def _decode(path: str, decode: Any, data: Any) -> None:
    global _decode_limiter
    if _decode_limiter is None:
        _decode_limiter = anyio.CapacityLimiter(IMAGE_DECODES)
    try:
        await anyio.to_thread.run_sync(decode, data, IMAGE_LIMITS, limiter=_decode_limiter)
    except ValueError as error:
        raise ImageRefused(path, str(error)) from None


async def _fetch(path: str, url: str, allow_private: bool, timeout_s: float) -> tuple[bytes, str | None]:
    """The image at an http(s) URL: one GET to the address the guard checked, within the byte and time caps."""
    try:
        target = await resolve_target_async(url, allow_private=allow_private, policy=(
            "images are fetched from public addresses only (GENQ_GATEWAY_IMAGE_URL_ALLOW_PRIVATE_HOSTS=true allows "
            "private ones in a trusted deployment)"))
    except CallbackUrlRefused as error:
        raise ImageRefused(path, f"the image URL is refused: {error}") from None
    extensions = {"sni_hostname": target.sni_hostname} if target.sni_hostname else {}
    chunks: list[bytes] = []
    try:
        with anyio.fail_after(timeout_s):
            async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client:
                request = client.build_request("GET", target.connect_url, extensions=extensions,
                                               headers={"Host": target.host_header, "Accept": "image/*"})
                response = await client.send(request, stream=True)
                try:
                    if response.status_code != 200:
                        raise ImageRefused(path, f"fetching the image URL answered HTTP {response.status_code} "
                                                 "(redirects are not followed)")
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
                        raise ImageRefused(path, f"the image at the URL is {declared} bytes, more than "
                                                 f"MAX_IMAGE_BYTES={MAX_IMAGE_BYTES}")
                    size = 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > MAX_IMAGE_BYTES:
                            raise ImageRefused(path, f"the image at the URL is more than MAX_IMAGE_BYTES="
                                                     f"{MAX_IMAGE_BYTES} bytes")
                        chunks.append(chunk)
                finally:
                    await response.aclose()
    except (TimeoutError, httpx.TimeoutException):
        raise ImageRefused(path, f"fetching the image URL took more than {timeout_s:g} s "
                                 "(GENQ_GATEWAY_IMAGE_FETCH_TIMEOUT_S)") from None
    except httpx.HTTPError as error:
        raise ImageRefused(path, f"fetching the image URL failed: {type(error).__name__}: {str(error)[:200]}") from None
    media_type = response.headers.get("content-type", "").partition(";")[0].strip().lower() or None
    return b"".join(chunks), media_type if media_type and _MEDIA_TYPE_RE.fullmatch(media_type) else None
