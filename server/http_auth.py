"""What serve and web both ask of an HTTP request: is a bind address loopback, and which bearer
token does it carry. Torch-free: web's server process imports it."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """host as given to --host: localhost, or a loopback address (IPv6 with or without brackets)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bearer_token(authorization: str) -> str | None:
    """The credentials of an `Authorization: Bearer T` header; the scheme in any case (RFC 7235)."""
    scheme, _, credentials = authorization.strip().partition(" ")
    return (credentials.strip() or None) if scheme.lower() == "bearer" else None
