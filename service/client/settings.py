"""Settings of the batch client: command-line values first, ``TILEWISE_*`` environment second.

============================  =============================================  =========
Variable                      Meaning                                        Default
============================  =============================================  =========
``TILEWISE_API_KEY``          sent as ``Authorization: Bearer <key>``        none
``TILEWISE_URL``              server base URL when ``--url`` is not given    none
``TILEWISE_TIMEOUT_S``        ``--timeout``                                  300
``TILEWISE_RETRIES``          ``--retries``                                  5
``TILEWISE_RETRY_FOR_S``      ``--retry-for``: keep retrying this long       0 (CLI: 600)
``TILEWISE_CONCURRENCY``      ``--concurrency``                              2
``TILEWISE_BACKOFF_BASE_S``   first retry delay before jitter                0.5
``TILEWISE_BACKOFF_MAX_S``    largest retry delay (also caps Retry-After)    30
============================  =============================================  =========

The client reads no ``.env`` file; the server's variables (``TILEWISE_MODELS_DIR`` ...) are ignored.
It never imports :mod:`service.settings`, so it needs neither FastAPI nor torch.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.options import blank_to_none

__all__ = ["ClientSettings"]


class ClientSettings(BaseSettings):
    """Frozen configuration of one batch run (connection, retries, concurrency).

    Attributes:
        url: server base URL, ``http(s)://host:port`` (a path prefix is kept).
        api_key: API key, or ``None`` when the server needs none.
        timeout_s: per-request limit for connecting, sending and waiting for each response chunk;
            the server sends nothing until inference is done, so it must cover the slowest file.
        retries: extra attempts per file after a connection error, a timeout, or a 502/503/504.
        retry_for_s: seconds of waiting between attempts after which a file stops being retried,
            even when ``retries`` are left (and before which it goes on, when they are spent): long
            enough to outlast a server restart (``tilewise batch`` defaults it to 600).
        concurrency: files in flight at once.
        backoff_base_s: first retry delay before jitter; doubles on each retry.
        backoff_max_s: largest delay between two attempts (also caps ``Retry-After``).
    """

    model_config = SettingsConfigDict(
        env_prefix="TILEWISE_", frozen=True, extra="ignore", protected_namespaces=()
    )

    url: str
    api_key: Annotated[SecretStr | None, BeforeValidator(blank_to_none)] = None  # empty: no key
    timeout_s: float = Field(default=300.0, gt=0)
    retries: int = Field(default=5, ge=0)
    retry_for_s: float = Field(default=0.0, ge=0)
    concurrency: int = Field(default=2, ge=1)
    backoff_base_s: float = Field(default=0.5, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        """Require an absolute http(s) URL; drop a trailing slash."""
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"url={value!r} must start with http:// or https://")
        return value.rstrip("/")
