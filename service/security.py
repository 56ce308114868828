"""API keys with names: who a request is, compared in constant time, never logged.

Keys come from two settings; both may be given (their names must differ):

- ``TILEWISE_API_KEY``: one key, named ``default``. Alone it is the operator's key of a one-user
  deployment, so it is an **admin** key (it sees every job and may reload the models).
- ``TILEWISE_API_KEYS``: a file of named keys, one a line (``#`` comments and blank lines skipped)::

      alice:Zm9vYmFyYmF6cXV4...           a key as is
      bob:sha256:9f86d081884c7d65...      the SHA-256 (hex) of the key: the file holds no secret
      admin:sha256:2c26b46b68ffc68f...    the key named ``admin`` is an admin key

  A name is 1 to 64 of ``A-Z a-z 0-9 _ . @ -``; a key at least 16 characters. A malformed file
  stops the start-up (:class:`KeyRing` raises ``ValueError`` naming the line, never the key).

A request sends ``Authorization: Bearer <key>``. Every configured key is compared with the
token's SHA-256 by :func:`hmac.compare_digest` (time independent of where they differ, and of
which key matched). The request's :class:`Principal` (the key's name, admin or not) is put on
``request.state.principal``; the jobs routes record the name as the job's owner and show a
client only its own jobs. With no key configured every request is the anonymous admin (as a
loopback-only server, or with ``TILEWISE_ALLOW_ANONYMOUS=true``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPBearer

from service.errors import AuthenticationError, ForbiddenError
from service.jobs.index import OWNER_RE

__all__ = [
    "ADMIN",
    "ANONYMOUS",
    "DEFAULT",
    "KeyRing",
    "Principal",
    "principal_of",
    "require_admin",
    "require_api_key",
]

logger = logging.getLogger(__name__)

#: The name of the admin key in ``TILEWISE_API_KEYS``.
ADMIN = "admin"
#: The name of ``TILEWISE_API_KEY``.
DEFAULT = "default"
MIN_KEY_CHARS = 16


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request: the key's name (``None``: no key configured) and whether it is admin."""

    name: str | None
    admin: bool

    def may_see(self, owner: str | None) -> bool:
        """Whether this client may see (read, download, cancel) a job of ``owner``."""
        return self.admin or owner == self.name


ANONYMOUS = Principal(None, admin=True)


@dataclass(frozen=True, slots=True)
class _Key:
    name: str
    digest: bytes  # SHA-256 of the key
    admin: bool


class KeyRing:
    """The configured keys.

    Args:
        single: ``TILEWISE_API_KEY`` (named ``default``, admin), or ``None``.
        path: ``TILEWISE_API_KEYS`` (a file of ``name:key`` / ``name:sha256:HEX`` lines), or ``None``.

    Raises:
        ValueError: a malformed line, a short key, a repeated name, or an unreadable file.
    """

    def __init__(self, single: str | None = None, path: Path | None = None) -> None:
        keys: list[_Key] = []
        if single is not None:
            keys.append(_Key(DEFAULT, _digest(single), admin=True))
        if path is not None:
            keys += _read_keys(Path(path))
        names = [k.name for k in keys]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"API key names used twice: {', '.join(repeated)}")
        self._keys = tuple(keys)

    @classmethod
    def from_settings(cls, settings: object) -> KeyRing:
        """The keys of :class:`~service.settings.Settings` (``api_key``, ``api_keys``)."""
        single = getattr(settings, "api_key", None)
        text = single.get_secret_value() if single is not None else None
        return cls(text, getattr(settings, "api_keys", None))

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (else every request is anonymous)."""
        return bool(self._keys)

    def names(self) -> list[str]:
        """The names of the keys (for the start-up log; never the keys)."""
        return [k.name for k in self._keys]

    def identify(self, token: str) -> Principal | None:
        """The principal of ``token``, or ``None`` when no key matches (every key compared)."""
        digest = _digest(token)
        found: _Key | None = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key
        return Principal(found.name, found.admin) if found is not None else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _read_keys(path: Path) -> list[_Key]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"TILEWISE_API_KEYS: cannot read {path}: {exc.__class__.__name__}") from None
    keys = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, secret = line.partition(":")
        where = f"TILEWISE_API_KEYS {path} line {number}"
        if not sep or not OWNER_RE.fullmatch(name):
            raise ValueError(f"{where}: expected name:key or name:sha256:HEX (name: 1-64 of A-Za-z0-9_.@-)")
        kind, sep, hexdigest = secret.partition(":")
        if kind == "sha256" and sep:
            try:
                digest = bytes.fromhex(hexdigest)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise ValueError(f"{where}: sha256: needs 64 hex digits")
        elif len(secret) < MIN_KEY_CHARS:
            raise ValueError(f"{where}: the key of {name} is shorter than {MIN_KEY_CHARS} characters")
        else:
            digest = _digest(secret)
        keys.append(_Key(name, digest, admin=name == ADMIN))
    return keys


def _keyring(request: Request) -> KeyRing:
    state = request.app.state
    ring: KeyRing | None = getattr(state, "keyring", None)
    if ring is None:
        ring = state.keyring = KeyRing.from_settings(state.settings)
    return ring


#: Documents the scheme in the OpenAPI document (``security``); the header is checked below.
_BEARER = HTTPBearer(
    auto_error=False,
    description="An API key (`TILEWISE_API_KEY`, `TILEWISE_API_KEYS`) when the server has keys.",
)


async def require_api_key(
    request: Request, _documented: Annotated[object, Depends(_BEARER)] = None
) -> Principal:
    """FastAPI dependency: the request's :class:`Principal` (also on ``request.state.principal``).

    Raises:
        AuthenticationError: keys are configured and the header is missing, not a bearer token,
            or matches none of them (401; the token is never logged).
    """
    ring = _keyring(request)
    if not ring.enabled:
        principal = ANONYMOUS
    else:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        found = ring.identify(token.strip()) if scheme.lower() == "bearer" else None
        if found is None:
            raise AuthenticationError("missing or wrong API key: send 'Authorization: Bearer <key>'")
        principal = found
    request.state.principal = principal
    return principal


async def require_admin(
    request: Request, _documented: Annotated[object, Depends(_BEARER)] = None
) -> Principal:
    """FastAPI dependency: an admin key (or no key configured).

    Raises:
        AuthenticationError: no valid key (401).
        ForbiddenError: a valid key that is not an admin key (403).
    """
    principal = await require_api_key(request)
    if not principal.admin:
        raise ForbiddenError(f"key {principal.name!r} is not an admin key (the key named {ADMIN!r} is)")
    return principal


def principal_of(request: Request) -> Principal:
    """The principal :func:`require_api_key` found for ``request`` (anonymous when none ran)."""
    return getattr(request.state, "principal", ANONYMOUS)
