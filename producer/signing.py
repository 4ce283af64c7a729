"""HMAC signatures of webhook requests and completion callbacks.

One scheme both ways (what Stripe and GitHub do, combined): the signer puts
the unix time in `X-Genq-Timestamp` and
``sha256=hex(HMAC-SHA256(secret, f"{timestamp}.".encode() + raw_body))`` in
`X-Genq-Signature`. Signing the timestamp with the body lets the verifier
refuse old requests (a replay window) without trusting an unsigned header;
comparing in constant time keeps the digest from leaking byte by byte.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Literal

__all__ = [
    "SIGNATURE_HEADER",
    "SIGNATURE_SCHEME",
    "TIMESTAMP_HEADER",
    "SignatureError",
    "sign",
    "signed_headers",
    "task_access_token",
    "verify",
]

TIMESTAMP_HEADER = "X-Genq-Timestamp"
SIGNATURE_HEADER = "X-Genq-Signature"
SIGNATURE_SCHEME = "sha256"

SignatureProblem = Literal["missing", "malformed", "stale", "mismatch"]


class SignatureError(ValueError):
    """A signature that does not authenticate its request; `problem` says which check failed."""

    def __init__(self, problem: SignatureProblem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The `X-Genq-Signature` value for a body sent at `timestamp` (unix seconds)."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"{SIGNATURE_SCHEME}={digest}"


def signed_headers(secret: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """Both headers for a request carrying `body`, signed now unless a timestamp is given."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {TIMESTAMP_HEADER: str(timestamp), SIGNATURE_HEADER: sign(secret, timestamp, body)}


def verify(secret: str, body: bytes, timestamp: str | None, signature: str | None, *, window_s: float,
           now: float | None = None) -> str:
    """Check a request's signature and that its timestamp lies within `window_s` of now (either
    way: a clock running ahead is as suspicious as a stale request). Returns the hex digest, which
    identifies the request for replay detection; raises SignatureError."""
    if not timestamp or not signature:
        raise SignatureError("missing", f"the {TIMESTAMP_HEADER} and {SIGNATURE_HEADER} headers are required")
    try:
        sent_at = int(timestamp)
    except ValueError:
        raise SignatureError("malformed", f"{TIMESTAMP_HEADER} must be unix time in whole seconds") from None
    scheme, _, digest = signature.partition("=")
    if scheme != SIGNATURE_SCHEME or len(digest) != hashlib.sha256().digest_size * 2:
        raise SignatureError("malformed", f"{SIGNATURE_HEADER} must be '{SIGNATURE_SCHEME}=<64 hex digits>'")
    # The digest is checked before the time, so that only a holder of the secret learns about the clock.
    if not hmac.compare_digest(sign(secret, sent_at, body), f"{SIGNATURE_SCHEME}={digest.lower()}"):
        raise SignatureError("mismatch", "the signature does not match the body and timestamp")
    skew = (time.time() if now is None else now) - sent_at
    if abs(skew) > window_s:
        raise SignatureError("stale", f"the timestamp is {abs(skew):.0f} s {'old' if skew > 0 else 'ahead'}; "
                                      f"requests must be signed within {window_s:.0f} s of being received")
    return digest.lower()


def task_access_token(secret: str, identifier: str, nonce: str) -> str:
    """A read/cancel capability for one task, handed to the webhook sender in its 202 answer, so
    that a deployment authenticated by signatures alone can still follow its tasks (and a browser
    EventSource, which cannot set headers, can pass it in the URL). `nonce` is the random value
    the gateway chose when it accepted the task: without it the token cannot be derived from the
    (caller-chosen) identifier, so a later request reusing the id learns nothing."""
    message = f"genq-task-access:{identifier}:{nonce}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
