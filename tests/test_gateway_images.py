"""Images through a real worker serving a tiny LLaVA directory (genq_dev/tiny_vlm.py) and the real
gateway, with the real `openai` SDK (issue 27): the card says what the model takes, bad images are
refused naming their part (at the gateway with a 400, at the worker with a ProtocolError) before
anything reaches the vision tower, a good one gets the text the engine gives for it, image URLs are
fetched by the gateway through the callbacks' SSRF guard, and the worker keeps serving text after
all of it."""

from __future__ import annotations

import base64
import io
import struct
import threading
import uuid
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from fastapi.testclient import TestClient
from PIL import Image

from engine import Generator, Job
from engine.vision.images import expand_image_placeholders
from genq_dev.tiny_vlm import make_tiny_vlm
from image_input import decode_image
from producer.client import GenerationError, GenqClient
from producer.gateway import GatewaySettings, create_app
from producer.model_card import WorkerCard, card_key
from producer.protocol import DEFAULT_KEY_PREFIX, MAX_IMAGE_BYTES, MAX_IMAGES
from tests.engine_runs import run
from tests.gateway_service import MODEL, QUEUE, TOKEN, GatewayProcess, bearer, service_env
from worker.processes import WorkerProcess

FETCH_TIMEOUT_S = 3
PLACEHOLDER = "turn"
"""The tiny LLaVA's image token (the vocabulary's last id) is the word "turn": its tokenizer has no <image>."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Overrides tests/gateway_service.py's: the module's worker serves a tiny LLaVA."""
    return make_tiny_vlm(tmp_path_factory.mktemp("llava"), "llava", text={"max_position_embeddings": 1024})


@pytest.fixture(scope="module")
def gateway_process(worker: WorkerProcess, redis_url: str,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """The gateway, allowed to fetch image URLs from the test's own server on loopback (the documented
    opt-out for trusted deployments; test_a_private_image_url_is_refused_by_default shows the default)."""
    env = {**service_env(redis_url), "GENQ_GATEWAY_TOKEN": TOKEN, "GENQ_GATEWAY_MODEL_NAME": MODEL,
           "GENQ_GATEWAY_IMAGE_URL_ALLOW_PRIVATE_HOSTS": "true",
           "GENQ_GATEWAY_IMAGE_FETCH_TIMEOUT_S": str(FETCH_TIMEOUT_S)}
    started = GatewayProcess(env, tmp_path_factory.mktemp("gateway") / "gateway.log").start()
    try:
        yield started
    finally:
        started.stop()


def png(size: tuple[int, int] = (24, 20)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).save(out, "PNG")
    return out.getvalue()


def bomb() -> bytes:
    """A valid PNG header claiming 100,000 x 100,000 pixels, a few hundred bytes long."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\x00" * 301)) + chunk(b"IEND", b"")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def chat(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]


class ImageServer:
    """The test's image host on loopback: /ok.png, /big (past MAX_IMAGE_BYTES), /page.html, /slow
    (answers once released), anything else 404."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.paths: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                server.paths.append(self.path)
                if self.path == "/slow":
                    server.release.wait(60)
                body, kind = {"/ok.png": (png(), "image/png"), "/slow": (png(), "image/png"),
                              "/page.html": (b"<html>not an image</html>", "text/html"),
                              "/big": (b"\x00" * (MAX_IMAGE_BYTES + 1), "image/png")}.get(self.path, (b"", ""))
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", kind or "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the gateway stopped reading at its cap

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"


@pytest.fixture(scope="module")
def image_server() -> Iterator[ImageServer]:
    server = ImageServer()
    thread = threading.Thread(target=server.http.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.http.shutdown()
        server.http.server_close()


def refusal(oai: openai.OpenAI, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The 400 a chat request gets: OpenAI's error object."""
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict), body
    return body


def assert_serves_text(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")


# --- the card and the worker ---------------------------------------------------------------------


def test_the_card_says_what_images_the_model_takes(worker: WorkerProcess, redis_url: str):
    key = card_key(QUEUE, DEFAULT_KEY_PREFIX)
    assert key is not None
    entries = redis.Redis.from_url(redis_url).hvals(key)
    cards = [WorkerCard.model_validate_json(raw) for raw in entries]
    images = {card.images for card in cards}
    assert len(images) == 1
    support = images.pop()
    assert support is not None
    # (32 / 8)^2 CLIP patches; the "default" strategy drops the class token, so 16 rows
    assert (support.placeholder, support.tokens_per_image, support.max_images) == (PLACEHOLDER, 16, MAX_IMAGES)


@pytest.mark.parametrize(("prompt", "image", "expected"), [
    (PLACEHOLDER, "iVBORw0K*GgoAAAA", "images[0]: base64 data is malformed: the character '*' at position 8"),
    (PLACEHOLDER, b64(b"GIF89a but not really"), "images[0]: data is not an image file Pillow can read"),
    (PLACEHOLDER, b64(bomb()), "images[0]: image is a decompression bomb"),
    ("no mark here", b64(png()), "prompt: holds the image placeholder 'turn' 0 time(s) for 1 image(s)"),
], ids=["malformed-base64", "not-an-image", "bomb", "placeholder-count"])
def test_the_worker_refuses_bad_images_naming_them(genq: GenqClient, prompt: str, image: str, expected: str):
    with pytest.raises(GenerationError) as info:
        genq.submit({"prompt": prompt, "images": [{"data": image}], "max_new_tokens": 2}).result(timeout=60)
    assert expected in info.value.message, info.value.message


def engine_greedy(model_dir: Path, prompt: str, image: bytes, max_new_tokens: int) -> list[int]:
    """The engine's greedy tokens for `prompt` with `image` at its placeholder, run in this process."""
    generator = Generator.from_pretrained(str(model_dir))
    assert generator.vision is not None
    embeddings = generator.vision.encode([[decode_image(image)]])[0]
    ids = generator.tokenizer.encode(prompt, add_special_tokens=generator.tokenizer.add_bos_token)
    job = Job(expand_image_placeholders(ids, embeddings, generator.vision.image_token_id), max_new_tokens,
              embeddings=embeddings, stop_conditions=[], identifier="reference")
    return run(generator, [job])["reference"].completion_ids or []


def test_a_good_image_gets_the_engine_s_greedy_tokens(genq: GenqClient, model_dir: Path):
    prompt = f"{PLACEHOLDER} describe"
    request = {"prompt": prompt, "images": [{"data": b64(png()), "media_type": "image/png"}], "max_new_tokens": 6,
               "ignore_eos": True, "sampling": {"temperature": 0}}
    result = genq.submit(request).result(timeout=60)
    assert result.token_ids == engine_greedy(model_dir, prompt, png(), 6)
    different = genq.submit({**request, "images": [{"data": b64(png((5, 40)))}]}).result(timeout=60)
    assert different.usage.prompt_tokens == result.usage.prompt_tokens
    assert genq.submit({"prompt": "Hello", "max_new_tokens": 2}).result(timeout=60).finish_reason == "length"


# --- the gateway ---------------------------------------------------------------------------------


def described(oai: openai.OpenAI, url: str) -> str:
    reply = oai.chat.completions.create(model=MODEL, messages=chat(image_part(url, detail="low")),  # type: ignore[arg-type]
                                        max_tokens=6, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    return reply.choices[0].message.content or ""


def test_an_image_data_url_gets_the_same_text_as_the_native_chat(oai: openai.OpenAI, genq: GenqClient):
    text = described(oai, data_url(png()))
    native = genq.submit({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image", "data": b64(png())}]}],
        "max_new_tokens": 6, "sampling": {"temperature": 0}}).result(timeout=60)
    assert text == native.text
    assert_serves_text(oai)


@pytest.mark.parametrize(("url", "expected"), [
    ("data:image/png;base64,iVBORw0K*GgoAAAA", "base64 data is malformed"),
    (data_url(b"%PDF-1.4 not an image", "image/png"), "not an image file"),
    (data_url(bomb()), "decompression bomb"),
    ("data:text/html;base64,PGh0bWw+", "media type must be image/"),
    ("data:image/png,rawbytes", "must be base64"),
    ("ftp://example.com/a.png", "data: URL (data:image/png;base64,...) or http(s)"),
], ids=["malformed-base64", "not-an-image", "bomb", "not-image-media-type", "not-base64", "scheme"])
def test_a_broken_image_gets_a_400_naming_its_part(oai: openai.OpenAI, url: str, expected: str):
    body = refusal(oai, chat(image_part(data_url(png())), image_part(url)))
    assert body["param"] == "messages[0].content[2]" and expected in body["message"], body
    assert body["code"] == "invalid_image"


def test_too_many_images_get_a_400_naming_the_limit(oai: openai.OpenAI):
    body = refusal(oai, chat(*[image_part(data_url(png()))] * (MAX_IMAGES + 1)))
    assert body["param"] == f"messages[0].content[{MAX_IMAGES + 1}]", body
    assert f"at most {MAX_IMAGES} images per request (the model card), got {MAX_IMAGES + 1}" in body["message"]


def test_an_image_in_an_assistant_message_is_refused(oai: openai.OpenAI):
    messages = [*chat({"type": "text", "text": "x"}),
                {"role": "assistant", "content": [image_part(data_url(png()))]},
                {"role": "user", "content": "and?"}]
    body = refusal(oai, messages)
    assert "image parts only in user messages" in body["message"], body


def test_image_urls_are_fetched_by_the_gateway(oai: openai.OpenAI, image_server: ImageServer):
    assert described(oai, f"{image_server.url}/ok.png") == described(oai, data_url(png()))
    assert "/ok.png" in image_server.paths


@pytest.mark.parametrize(("path", "expected"), [
    ("/missing.png", "answered HTTP 404"),
    ("/page.html", "not an image file"),
    ("/big", f"more than MAX_IMAGE_BYTES={MAX_IMAGE_BYTES}"),
    ("/slow", f"took more than {FETCH_TIMEOUT_S} s (GENQ_GATEWAY_IMAGE_FETCH_TIMEOUT_S)"),
], ids=["404", "not-an-image", "oversized", "timeout"])
def test_an_image_url_that_fails_gets_a_400(oai: openai.OpenAI, image_server: ImageServer, path: str,
                                            expected: str):
    body = refusal(oai, chat(image_part(f"{image_server.url}{path}")))
    assert body["param"] == "messages[0].content[1]" and expected in body["message"], body


@pytest.mark.parametrize(("request_body", "param", "expected"), [
    ({"prompt": PLACEHOLDER, "images": [{"data": "iVBORw0K*GgoAAAA"}]}, "images[0]", "base64 data is malformed"),
    ({"prompt": PLACEHOLDER, "images": [{"data": b64(bomb())}]}, "images[0]", "decompression bomb"),
    ({"prompt": "no mark", "images": [{"data": b64(png())}]}, "prompt", "placeholder 'turn' 0 time(s) for 1"),
    ({"messages": chat({"type": "image", "data": b64(b"not an image")})}, "messages[0].content[1]",
     "not an image file"),
], ids=["malformed-base64", "bomb", "placeholder-count", "chat-not-an-image"])
def test_the_native_endpoint_checks_images_too(gateway: str, request_body: dict[str, Any], param: str,
                                               expected: str):
    response = httpx.post(f"{gateway}/v1/tasks", headers=bearer(), json=request_body, timeout=30)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and expected in error["message"], error


def test_completions_take_no_images(oai: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt=PLACEHOLDER, max_tokens=2,
                               extra_body={"images": [{"data": b64(png())}]})
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "images" and "takes no images" in body["message"], body
    assert_serves_text(oai)


def test_a_private_image_url_is_refused_by_default(redis_url: str, image_server: ImageServer):
    """The default policy, in this process, in front of a queue no worker consumes (no card: the
    gateway still checks the images)."""
    queue = f"genq-images-{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings(token=TOKEN, redis_url=redis_url, queue=queue, model_name=MODEL)
    fetched = len(image_server.paths)
    with TestClient(create_app(settings)) as client:
        for url in (f"{image_server.url}/ok.png", "http://169.254.169.254/latest/meta-data/",
                    "http://[::ffff:127.0.0.1]/x.png"):
            response = client.post("/v1/chat/completions", headers=bearer(), json={
                "model": MODEL, "messages": chat(image_part(url))})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "messages[0].content[1]", error
            assert "image URL is refused" in error["message"] and "GENQ_GATEWAY_IMAGE_URL_ALLOW_PRIVATE_HOSTS" in \
                error["message"], error
    assert len(image_server.paths) == fetched  # nothing was fetched
    assert redis.Redis.from_url(redis_url).llen(queue) == 0


def tokenized(gateway: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    reply = httpx.post(f"{gateway}/tokenize", json={"model": MODEL, "messages": messages}, headers=bearer(),
                       timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_tokenize_counts_a_chat_s_image_as_the_worker_does(oai: openai.OpenAI, gateway: str):
    messages = chat(image_part(data_url(png())))
    counted = tokenized(gateway, messages)
    reply = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens == counted["count"] == len(counted["tokens"])
    image_token = counted["tokens"].index(max(counted["tokens"]))  # the vocabulary's last id
    assert counted["tokens"][image_token:image_token + 16] == [counted["tokens"][image_token]] * 16


def test_tokenize_refuses_an_unknown_key_in_an_image_part_naming_it(gateway: str):
    messages = chat(image_part(data_url(png()), detial="low"))
    reply = httpx.post(f"{gateway}/tokenize", json={"model": MODEL, "messages": messages}, headers=bearer(),
                       timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("unknown_parameter", "messages[0].content[1].image_url.detial")


def test_a_chat_whose_image_tokens_overflow_the_context_is_refused_before_queueing(oai: openai.OpenAI,
                                                                                 gateway: str):
    """The text and the completion fit; the image's 16 tokens (the card's tokens_per_image) do not: the same
    400 the text-only length check gives, before anything is queued."""
    messages = chat(image_part(data_url(png())))
    counted = tokenized(gateway, messages)
    room = counted["max_model_len"] - counted["count"]  # counted with the image's 16 tokens; its text alone
    # (the placeholder one token) and room + 1 completion tokens would fit
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=room + 1)  # type: ignore[arg-type]
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "context_length_exceeded", error
    assert f"{counted['count']} in the messages with its 1 image(s) at 16 tokens each" in error["message"]


def test_the_worker_keeps_serving(oai: openai.OpenAI, gateway: str):
    assert_serves_text(oai)
    assert httpx.get(f"{gateway}/healthz", timeout=5).status_code == 200


