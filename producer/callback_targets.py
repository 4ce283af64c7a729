"""Where a completion callback may be sent: the guard against a webhook sender using the gateway
to reach internal services (server-side request forgery).

A `callback_url` is chosen by whoever sends the webhook, and the POST to it comes from inside the
deployment, next to Redis, cloud metadata endpoints and admin ports. So:

- only `http` and `https`, always;
- no control characters: URL parsers (pydantic's, urllib's) silently drop tabs, CRs and LFs, so
  the URL called would not be the one sent;
- by default, every address the host resolves to must be globally routable: loopback,
  link-local, private, shared (CGNAT), multicast, unspecified, reserved and documentation ranges
  are refused, including IPv4 addresses inside IPv6 (IPv4-mapped, 6to4, Teredo, NAT64). The
  host is resolved with the system resolver, the same one the HTTP client uses, so every
  spelling it accepts (`2130706433`, `0x7f.1`, `017700000001`, `[::ffff:127.0.0.1]`) is judged
  by the address it means;
- `GENQ_CALLBACK_ALLOW_PRIVATE_HOSTS=true` lifts the address rule for a trusted deployment whose
  receivers live on a private network (the tests' receiver listens on 127.0.0.1).

The gateway fetches OpenAI `image_url` URLs through this guard too (producer/gateway/images.py, with
its own opt-out, GENQ_GATEWAY_IMAGE_URL_ALLOW_PRIVATE_HOSTS).

The gateway checks at acceptance (a clear 422), and the callback worker checks again at delivery
and then connects to the very address it checked (the URL's host replaced by that address, the
original name kept in the Host header and in TLS SNI and certificate checks), so a DNS answer
that changes between check and connection (DNS rebinding) cannot redirect the request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "ALLOWED_SCHEMES",
    "RESOLVE_TIMEOUT_S",
    "CallbackTarget",
    "CallbackUrlRefused",
    "check_characters",
    "refusal",
    "resolve_target",
    "resolve_target_async",
]

ALLOWED_SCHEMES = frozenset({"http", "https"})
RESOLVE_TIMEOUT_S = 5.0
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SHARED = ipaddress.IPv4Network("100.64.0.0/10")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class CallbackUrlRefused(ValueError):
    """A callback URL that must not be called; the message says why. `retryable` marks a
    resolver failure, which may pass (the address rules never do)."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class CallbackTarget:
    """A checked callback URL and how to reach exactly the address that was checked."""

    url: str
    address: str
    connect_url: str
    host_header: str
    sni_hostname: str | None


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries and would be routed to, if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def refusal(address: Address) -> str | None:
    """Why a callback must not go to `address` by default ("127.0.0.1, a loopback address"),
    or None when it may."""
    if isinstance(address, ipaddress.IPv6Address) and (inner := _embedded_ipv4(address)) is not None:
        reason = refusal(inner)
        return None if reason is None else f"{reason} (carried inside the IPv6 address {address})"
    for kind, matches in (("an unspecified", address.is_unspecified), ("a loopback", address.is_loopback),
                          ("a link-local", address.is_link_local), ("a multicast", address.is_multicast),
                          ("a private", address.is_private),
                          ("a shared (carrier-grade NAT)", isinstance(address, ipaddress.IPv4Address)
                           and address in _SHARED),
                          ("a reserved", address.is_reserved), ("a non-global", not address.is_global)):
        if matches:
            return f"{address}, {kind} address"
    return None


def check_characters(url: str) -> None:
    """CallbackUrlRefused if the URL holds a control character (CR, LF, tab, ..., DEL), which a
    parser would drop or encode rather than refuse."""
    for position, char in enumerate(url):
        if char < " " or char == "\x7f":
            raise CallbackUrlRefused(f"the URL holds the control character {char!r} at position {position}; "
                                     "a URL has none")


def _parts(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, explicit port) of a URL this module may judge; CallbackUrlRefused if none."""
    check_characters(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise CallbackUrlRefused(f"not a valid URL: {error}") from None
    scheme = parts.scheme.lower()
    if scheme not in ALLOWED_SCHEMES:
        raise CallbackUrlRefused(f"the scheme must be http or https, got {scheme or 'none'!r}")
    if not parts.hostname:
        raise CallbackUrlRefused("the URL has no host")
    return scheme, parts.hostname, port


CALLBACK_POLICY = ("callbacks go to public addresses only (GENQ_CALLBACK_ALLOW_PRIVATE_HOSTS=true allows private "
                   "ones in a trusted deployment)")
"""What a refusal of a private address says by default; the gateway's image fetching says its own."""


def _target(url: str, scheme: str, host: str, port: int | None, addresses: list[Address],
            allow_private: bool, policy: str = CALLBACK_POLICY) -> CallbackTarget:
    if not addresses:
        raise CallbackUrlRefused(f"the host {host!r} resolves to no address", retryable=True)
    if not allow_private:
        for address in addresses:
            if (reason := refusal(address)) is not None:
                raise CallbackUrlRefused(f"the host {host!r} resolves to {reason}; {policy}")
    address = addresses[0]
    literal = f"[{address}]" if address.version == 6 else str(address)
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (f"{userinfo}@" if userinfo else "") + literal + (f":{port}" if port is not None else "")
    original_host = f"[{host}]" if ":" in host else host
    host_header = original_host + (f":{port}" if port is not None else "")
    sni = host if scheme == "https" and not _is_ip_literal(host) else None
    return CallbackTarget(url=url, address=str(address), connect_url=urlunsplit(parts._replace(netloc=netloc)),
                          host_header=host_header, sni_hostname=sni)


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _addresses(infos: list[tuple]) -> list[Address]:
    seen: dict[Address, None] = {}
    for info in infos:
        # A scoped IPv6 address ("fe80::1%eth0") is link-local whatever its scope.
        seen[ipaddress.ip_address(str(info[4][0]).partition("%")[0])] = None
    return list(seen)


def _resolver_error(host: str, error: OSError | UnicodeError) -> CallbackUrlRefused:
    if isinstance(error, UnicodeError):  # an empty or over-long label: no resolver would take it
        return CallbackUrlRefused(f"the host {host[:80]!r} is not a valid host name")
    return CallbackUrlRefused(f"the host {host[:80]!r} does not resolve: {error}", retryable=True)


def resolve_target(url: str, *, allow_private: bool) -> CallbackTarget:
    """Check `url` for a delivery now (blocking resolver call). Raises CallbackUrlRefused."""
    scheme, host, port = _parts(url)
    try:
        infos = socket.getaddrinfo(host, port or (443 if scheme == "https" else 80), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        raise _resolver_error(host, error) from None
    return _target(url, scheme, host, port, _addresses(infos), allow_private)


async def resolve_target_async(url: str, *, allow_private: bool, policy: str = CALLBACK_POLICY) -> CallbackTarget:
    """resolve_target for asyncio callers (the gateway: callback URLs, and the image URLs it fetches,
    whose refusals state `policy`), bounded by RESOLVE_TIMEOUT_S."""
    scheme, host, port = _parts(url)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await loop.getaddrinfo(host, port or (443 if scheme == "https" else 80), type=socket.SOCK_STREAM)
    except TimeoutError:
        raise CallbackUrlRefused(f"the host {host!r} did not resolve within {RESOLVE_TIMEOUT_S:.0f} s",
                                 retryable=True) from None
    except (OSError, UnicodeError) as error:
        raise _resolver_error(host, error) from None
    return _target(url, scheme, host, port, _addresses(infos), allow_private, policy)
