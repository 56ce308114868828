"""Optional API key: ``Authorization: Bearer <key>``, compared in constant time."""

from __future__ import annotations

import hmac
import logging

from fastapi import Request

from service.errors import AuthenticationError

__all__ = ["require_api_key"]

logger = logging.getLogger(__name__)


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: pass when no key is configured or the bearer token matches it.

    Raises:
        AuthenticationError: the header is missing, not a bearer token, or the wrong key (401).
    """
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    expected = key.get_secret_value().encode("utf-8")
    # compare_digest runs in time independent of where the strings differ.
    matches = hmac.compare_digest(token.strip().encode("utf-8"), expected)
    if scheme.lower() != "bearer" or not matches:
        raise AuthenticationError("missing or wrong API key: send the header 'Authorization: Bearer <key>'")
