"""Which hosts and which sites may talk to the server: ``Host`` validation and a cross-site check.

:class:`RequestGuardMiddleware` (pure ASGI) refuses, before any route runs:

- a ``Host`` header that names none of ``TILEWISE_ALLOWED_HOSTS`` (400 ``bad_host``): a page on
  ``evil.example`` whose name is made to resolve to 127.0.0.1 (DNS rebinding) sends
  ``Host: evil.example`` and is refused. Loopback names (``localhost``, ``127.0.0.1``, ``::1``) are
  always accepted, and ``/healthz`` and ``/readyz`` are never refused (probes use addresses);
- a state-changing request (``POST``, ``PUT``, ``PATCH``, ``DELETE``) sent by a page of another
  site (403 ``cross_origin``): its ``Origin`` names another host than the request's ``Host`` and
  none of ``TILEWISE_CORS_ORIGINS``, or, without ``Origin``, ``Sec-Fetch-Site`` says
  ``cross-site``. Browsers send ``Origin`` with every cross-origin ``POST``, so a ``text/plain``
  or ``multipart/form-data`` form on another site (a CORS "simple" request, sent without a
  preflight) cannot create a job or reload the models. Clients that are not browsers (the batch
  client, curl) send neither header and pass; the page, served from the same origin, passes.

Hosts are compared without their ports (behind nginx ``Host`` is ``$host``, which drops the port,
while ``Origin`` keeps it): pages on another port of the same host are not refused.

CORS itself is off unless ``TILEWISE_CORS_ORIGINS`` is set (:func:`install_guards` then adds
Starlette's ``CORSMiddleware`` for those origins only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["LOOPBACK_HOSTS", "RequestGuardMiddleware", "host_allowed", "host_name"]

#: Names a loopback client uses; always accepted as ``Host``.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_PROBES = frozenset({"/healthz", "/readyz"})


def host_name(value: str) -> str:
    """The host of a ``Host`` header or an origin's authority, lower-case, without port or brackets
    (``[::1]:8000`` -> ``::1``, ``Example.org:80`` -> ``example.org``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value[1:]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    """Whether ``host`` (a name, see :func:`host_name`) matches one of ``allowed``: ``*`` (any), a
    name, or ``.example.org`` (that domain and its subdomains). Loopback names always match."""
    if not host:
        return False
    if host in LOOPBACK_HOSTS:
        return True
    for pattern in allowed:
        pattern = pattern.strip().lower()
        if pattern == "*" or host == host_name(pattern):
            return True
        if pattern.startswith(".") and (host == pattern[1:] or host.endswith(pattern)):
            return True
    return False


class RequestGuardMiddleware:
    """Refuse unknown ``Host`` names and cross-site state-changing requests (see the module).

    Args:
        app: the wrapped ASGI app.
        allowed_hosts: accepted ``Host`` names (``None``: any).
        cors_origins: origins (``scheme://host[:port]``) allowed to send state-changing requests.
        respond: ``respond(status, code, detail)`` builds the JSON error.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        allowed_hosts: Iterable[str] | None,
        cors_origins: Iterable[str] | None,
        respond: Callable[[int, str, str], Response],
    ) -> None:
        self.app = app
        self.allowed_hosts = tuple(allowed_hosts) if allowed_hosts is not None else None
        self.cors_origins = frozenset(o.strip().rstrip("/").lower() for o in cors_origins or ())
        self.respond = respond

    def _refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        headers = Headers(scope=scope)
        host = host_name(headers.get("host", ""))
        if self.allowed_hosts is not None and scope.get("path") not in _PROBES:
            if not host_allowed(host, self.allowed_hosts):
                detail = "the Host header names no host this server answers for (TILEWISE_ALLOWED_HOSTS)"
                return 400, "bad_host", detail
        if scope.get("method") not in _STATE_CHANGING:
            return None
        origin = headers.get("origin")
        if origin is not None:
            origin = origin.strip().rstrip("/").lower()
            if origin in self.cors_origins:
                return None
            parts = urlsplit(origin)
            if parts.scheme in ("http", "https") and parts.hostname and host_name(parts.netloc) == host:
                return None
            return (
                403,
                "cross_origin",
                (
                    f"a {scope.get('method')} from a page of another origin ({origin[:100]}) is refused; "
                    "allow its origin with TILEWISE_CORS_ORIGINS"
                ),
            )
        if headers.get("sec-fetch-site", "").lower() == "cross-site":
            return 403, "cross_origin", "a state-changing request from another site is refused"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await self.respond(*refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)
