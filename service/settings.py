"""Service settings, read from ``TILEWISE_*`` environment variables (and a ``.env`` file).

=============================  ==========================================================
Variable                       Meaning
=============================  ==========================================================
``TILEWISE_MODELS_DIR``        model repository folder (default: ``models.DEFAULT_MODELS_DIR``)
``TILEWISE_DEVICE``            ``cpu``, ``cuda``, ``cuda:1`` ... (default: CUDA when available)
``TILEWISE_MAX_UPLOAD_BYTES``  largest accepted upload in bytes (413 beyond)
``TILEWISE_MAX_VOXELS``        largest accepted image, voxels or pixels times slices (413 beyond)
``TILEWISE_MAX_IMAGE_PIXELS``  Pillow's decompression-bomb limit for 2D images (413 beyond)
``TILEWISE_QUEUE_SIZE``        requests allowed to wait for the device (503 beyond)
``TILEWISE_API_KEY``           when set, ``/v1/*`` requires ``Authorization: Bearer <key>``
``TILEWISE_RETRY_AFTER_S``     the ``Retry-After`` value sent with 503
``TILEWISE_TMP_DIR``           folder for upload / result temporary files (default: system)
``TILEWISE_WARMUP``            run every model once on a tiny input at start-up
=============================  ==========================================================
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "get_settings"]


class Settings(BaseSettings):
    """Frozen service configuration; build one explicitly in tests, ``get_settings()`` elsewhere."""

    model_config = SettingsConfigDict(
        env_prefix="TILEWISE_",
        env_file=".env",
        # From .env only TILEWISE_* keys count (a compose file's other keys are ignored), and a
        # misspelt TILEWISE_* key fails at start-up (extra="forbid").
        dotenv_filtering="match_prefix",
        frozen=True,
        extra="forbid",
        protected_namespaces=(),
    )

    models_dir: Path | None = None
    device: str | None = None
    max_upload_bytes: int = Field(default=2 * 2**30, ge=1)
    max_voxels: int = Field(default=2**30, ge=1)
    # Pillow's own default is 89.5 Mpx; scanned documents and slides of 20000 x 20000 px are real.
    max_image_pixels: int = Field(default=500_000_000, ge=1)
    queue_size: int = Field(default=8, ge=0)
    api_key: SecretStr | None = None
    retry_after_s: int = Field(default=2, ge=0)
    tmp_dir: Path | None = None
    warmup: bool = True

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: object) -> object:
        """An empty ``TILEWISE_API_KEY=`` means no key, not the empty key."""
        if isinstance(value, str) and not value:
            return None
        return value

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: str | None) -> str | None:
        """Accept ``cpu``, ``cuda``, ``cuda:N`` and ``mps`` only; fail at start-up otherwise."""
        if value is None or value in {"", "auto"}:
            return None
        kind, _, index = value.partition(":")
        if kind not in {"cpu", "cuda", "mps"} or (index and not index.isdigit()):
            raise ValueError(f"device={value!r} is not one of 'cpu', 'cuda', 'cuda:N', 'mps'")
        return value


@lru_cache
def get_settings() -> Settings:
    """Settings from the environment, built once per process."""
    return Settings()
