"""Who a request comes from, for the per-client shares of the queue and of the upload slots.

A client is the name of its API key when the server has named keys (``TILEWISE_API_KEYS``: the
:class:`~service.security.Principal` that authentication put on ``request.state.principal``),
else its address (``request.client.host``; behind a proxy, the address uvicorn takes from
``X-Forwarded-For`` when the proxy is trusted, ``--forwarded-allow-ips``). The one
``TILEWISE_API_KEY`` of a one-user deployment names no client: its callers count by address.

- :func:`client_slots`: the most inference slots one client may hold at once,
  ``max(1, floor(TILEWISE_MAX_CLIENT_SHARE * (TILEWISE_QUEUE_SIZE + 1)))`` (4 of 9 by default), so
  that one client flooding the queue leaves room for the others
  (:meth:`service.executor.DeviceExecutor.reserve`).
- ``TILEWISE_MAX_UPLOADS_PER_CLIENT``: the most uploads in progress from one client
  (:class:`service.upload.UploadSlots`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.settings import Settings

__all__ = ["client_of", "client_slots"]

#: The name of ``TILEWISE_API_KEY`` (shared by every caller of a one-key server: not a client).
_SHARED_KEY_NAMES = frozenset({None, "default"})


def client_of(request: Any) -> str:
    """``key:NAME`` for a request authenticated by a named key, else ``addr:HOST`` (``addr:?``
    when the transport gives no address)."""
    principal = getattr(getattr(request, "state", None), "principal", None)
    name = getattr(principal, "name", None)
    if name not in _SHARED_KEY_NAMES:
        return f"key:{name}"
    peer = getattr(request, "client", None)
    host = getattr(peer, "host", None)
    return f"addr:{host or '?'}"


def client_slots(settings: Settings) -> int:
    """The inference slots one client may hold at once (see the module docstring)."""
    return max(1, math.floor(settings.max_client_share * (settings.queue_size + 1)))
