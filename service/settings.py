"""Service settings, read from ``TILEWISE_*`` environment variables (and a ``.env`` file).

================================  ===========================================================================
Variable                          Meaning
================================  ===========================================================================
``TILEWISE_MODELS_DIR``           model repository folder (default: ``models.DEFAULT_MODELS_DIR``)
``TILEWISE_USER_MODELS_DIR``      the folder ``tilewise setup-models`` fills (default
                                  ``~/.cache/tilewise/models``): its models are added to those of
                                  ``TILEWISE_MODELS_DIR`` when that is another folder
``TILEWISE_MEASUREMENTS_DIR``     warm-up measurements of built-in models and read-only model folders
                                  (default: ``~/.cache/tilewise/measurements``; a writable model
                                  folder keeps its own in ``.tilewise-measured/``)
``TILEWISE_DEVICE``               ``cpu``, ``cuda``, ``cuda:1`` ... (default: CUDA when available)
``TILEWISE_MAX_UPLOAD_BYTES``     largest accepted upload in bytes (413 beyond)
``TILEWISE_MAX_VOXELS``           largest accepted image, voxels or pixels times slices (413 beyond)
``TILEWISE_MAX_IMAGE_PIXELS``     Pillow's decompression-bomb limit for 2D images (413 beyond)
``TILEWISE_QUEUE_SIZE``           requests allowed to wait for the device, uploading or uploaded (503 beyond)
``TILEWISE_API_KEY``              one key: ``/v1/*`` then requires ``Authorization: Bearer <key>``; its
                                  name is ``default`` and it is an admin key (:mod:`service.security`)
``TILEWISE_API_KEYS``             a file of named keys, one ``name:key`` or ``name:sha256:HEX`` a line;
                                  a client sees only its own jobs, the key named ``admin`` every job
``TILEWISE_ALLOW_ANONYMOUS``      serve without a key on an address other than loopback (default false:
                                  ``tilewise serve`` refuses to start so)
``TILEWISE_ALLOWED_HOSTS``        ``Host`` names accepted, comma-separated (``*`` any, ``.example.org`` a
                                  domain and its subdomains; loopback names always); default: loopback
                                  names when ``tilewise serve`` binds a loopback address, else any
``TILEWISE_CORS_ORIGINS``         origins (``https://app.example.org``) whose pages may call the API,
                                  comma-separated (default: none; other origins' POST/DELETE are 403)
``TILEWISE_JOBS_MAX_BYTES``       bytes finished jobs may keep in the jobs folder; beyond, the oldest
                                  finished are removed first (sizes with units; default: no cap)
``TILEWISE_RETRY_AFTER_S``        the ``Retry-After`` value sent with 503
``TILEWISE_TMP_DIR``              folder for upload / result temporary files (default: system)
``TILEWISE_WARMUP``               run every model once on a tiny input at start-up
``TILEWISE_STRICT_MODELS``       a model that fails to load stops the server (default: listed unavailable)
``TILEWISE_GRACEFUL_SHUTDOWN_S``  on SIGTERM, seconds running requests get to finish (default 120)
``TILEWISE_DRAIN_S``              on SIGTERM, seconds ``/readyz`` fails (and responses close their
                                  connections) before the listener closes (default 5)
``TILEWISE_MAX_BATCH_SIZE``       largest ``batch_size`` of a request (422 beyond; default 256)
``TILEWISE_MAX_TILES``            most tiles one request may feed the network (422 beyond; default 65536)
``TILEWISE_MAX_WORK``             most voxels through the network per input voxel (422 beyond; default 64)
``TILEWISE_MAX_REQUEST_BYTES``    most memory one request's plan may predict (413 beyond; default: half
                                  the memory of the machine or container)
``TILEWISE_MAX_DECODED_BYTES``    bytes an input may declare once decompressed, from its header (413
                                  beyond; default 4 GiB, on its own: not the memory budget)
``TILEWISE_MAX_COMPRESSION_RATIO`` most bytes once decompressed per byte of the file, for inputs that
                                  inflate past 64 MiB (413 beyond; default 200; a gzip of zeros is ~1000)
``TILEWISE_MAX_REQUEST_SECONDS``  most network seconds a request's plan may predict (``eta_s``; 422
                                  beyond); a run past twice this is stopped (422 ``over_budget``; a job
                                  fails with the reason). Default 3600; 0: unbounded
``TILEWISE_MIN_VOXELS_PER_TILE``  input voxels per tile of one pass, at least, on the model grid (422
                                  below; the first 64 tiles are free; default 64)
``TILEWISE_MAX_CLIENT_SHARE``     share of the inference queue's slots one client may hold (503 beyond;
                                  at least one slot; default 0.5). A client is its API key's name with
                                  named keys, else its address
``TILEWISE_MEMORY_BUDGET``        bytes a request's plan should fit: picks the tile and batch size a request
                                  does not give (least predicted time within it; default: unset, the
                                  model's own, grown only where the halo eats the tile)
``TILEWISE_MMAP_THRESHOLD_BYTES`` allocations this large get their own mmap (glibc), so a request's peak is
                                  what it holds and predictable (default 131072; 0: glibc's own)
``TILEWISE_MAX_UPLOADS``          uploads in progress at once (503 beyond; default 16); an upload
                                  takes an inference slot only once its body has arrived
``TILEWISE_MAX_UPLOADS_PER_CLIENT`` uploads in progress at once from one client (503 beyond; default 4)
``TILEWISE_UPLOAD_MIN_RATE``      bytes/s an upload must average after the grace period (408 below;
                                  default 16384; 0: no minimum); rises with the uploads in progress:
                                  x1 up to half of ``TILEWISE_MAX_UPLOADS``, then up to x4 when all
``TILEWISE_UPLOAD_GRACE_S``       seconds before the minimum rate applies (default 10)
``TILEWISE_UPLOAD_IDLE_S``        seconds an upload may send nothing (408 beyond; default 30)
``TILEWISE_MAX_HEADER_BYTES``     request line plus headers, bytes (414 / 431 beyond; default 32768;
                                  ``tilewise serve`` only)
``TILEWISE_HEADER_TIMEOUT_S``     seconds a request's line and headers may take to arrive, from its first
                                  byte (or from the connection); then 408 and the connection closes
                                  (default 10; ``tilewise serve`` only)
``TILEWISE_MAX_CONNECTIONS``      open connections (and requests) at once; beyond, requests get 503
                                  (uvicorn's ``limit_concurrency``; default 256; ``tilewise serve`` only)
``TILEWISE_JOBS_DIR``             folder of the jobs (state, input, partial output, result); share it
                                  between replicas (default: ``tilewise-jobs`` in the temporary folder)
``TILEWISE_JOB_TTL_S``            seconds a finished job (and its result) is kept (default 86400)
``TILEWISE_JOB_LEASE_S``          a job's lease expires this long after its owner's last renewal
                                  (renewed every third of it); then another replica takes the job over
                                  (default 30; at once when the owner's process is gone, same host)
``TILEWISE_JOB_SCAN_S``           seconds between two looks for jobs to take over (default 1)
``TILEWISE_WEB_DIR``              folder of the page's viewer (NiiVue), filled by ``tilewise setup-web``
                                  (default: ``~/.cache/tilewise/web``)
``TILEWISE_DASK_SCHEDULER``       Dask scheduler address (``tcp://host:8786``; ``local:N`` starts a local
                                  cluster in the server) to which jobs send their large volumes
                                  (default: unset, every job runs in process)
``TILEWISE_DASK_MIN_VOXELS``      a job's input goes to the cluster when it has more voxels than this
                                  (spatial, before resampling; default 64000000, about 400^3)
``TILEWISE_DASK_WORKDIR``         folder the server and every Dask worker see at the same path, for the
                                  zarr copies of cluster jobs (default: the job's own folder)
================================  ===========================================================================

``tilewise serve`` has an option for each (``--api-key``, ``--queue-size`` ...); an option wins
over its variable.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from PIL import Image
from pydantic import BeforeValidator, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.memory import memory_limit_bytes
from service.options import blank_to_none, bytes_with_unit, comma_list

if TYPE_CHECKING:
    from models import ModelRepository

__all__ = ["Settings", "get_settings", "open_repository"]


class Settings(BaseSettings):
    """Frozen service configuration; build one explicitly in tests, ``get_settings()`` elsewhere."""

    model_config = SettingsConfigDict(
        env_prefix="TILEWISE_",
        env_file=".env",
        # From .env only TILEWISE_* keys count (a compose file's other keys are ignored), and a
        # misspelt TILEWISE_* key fails at start-up (extra="forbid"). Needs pydantic-settings>=2.14.
        dotenv_filtering="match_prefix",
        frozen=True,
        extra="forbid",
        protected_namespaces=(),
    )

    models_dir: Path | None = None
    user_models_dir: Path | None = None
    measurements_dir: Path | None = None
    device: str | None = None
    max_upload_bytes: int = Field(default=2 * 2**30, ge=1)
    max_voxels: int = Field(default=2**30, ge=1)
    # Pillow's own decompression-bomb threshold (89.5 Mpx); raise it for big scans and slides.
    # (Pillow's value is None when a program has turned its check off: its default then.)
    max_image_pixels: int = Field(default=Image.MAX_IMAGE_PIXELS or 89_478_485, ge=1)
    queue_size: int = Field(default=8, ge=0)
    #: Requests the device executor runs at once, sharing forward batches (service.sharing); 1: off.
    shared_requests: int = Field(default=1, ge=1, le=64)
    #: How long a shared forward batch that is not full waits for tiles (milliseconds).
    batch_wait_ms: float = Field(default=5.0, ge=0, le=1000)
    api_key: Annotated[SecretStr | None, BeforeValidator(blank_to_none)] = None  # empty: no key
    api_keys: Annotated[Path | None, BeforeValidator(blank_to_none)] = None
    allow_anonymous: bool = False
    allowed_hosts: Annotated[tuple[str, ...] | None, NoDecode, BeforeValidator(comma_list)] = None
    cors_origins: Annotated[tuple[str, ...] | None, NoDecode, BeforeValidator(comma_list)] = None
    jobs_max_bytes: Annotated[int | None, BeforeValidator(bytes_with_unit)] = Field(default=None, ge=1)
    retry_after_s: int = Field(default=2, ge=0)
    tmp_dir: Path | None = None
    warmup: bool = True
    strict_models: bool = False
    graceful_shutdown_s: int = Field(default=120, ge=0)
    drain_s: float = Field(default=5.0, ge=0)
    max_batch_size: int = Field(default=256, ge=1)
    max_tiles: int = Field(default=65536, ge=1)
    max_work: float = Field(default=64.0, gt=0)
    max_request_bytes: int = Field(default_factory=lambda: memory_limit_bytes() // 2, ge=1)
    max_decoded_bytes: int = Field(default=4 * 2**30, ge=1)
    max_compression_ratio: float = Field(default=200.0, ge=1)
    max_request_seconds: float = Field(default=3600.0, ge=0)
    min_voxels_per_tile: int = Field(default=64, ge=1)
    max_client_share: float = Field(default=0.5, gt=0, le=1)
    memory_budget: Annotated[int | None, BeforeValidator(bytes_with_unit)] = Field(default=None, ge=1)
    mmap_threshold_bytes: int = Field(default=131072, ge=0)
    max_uploads: int = Field(default=16, ge=1)
    max_uploads_per_client: int = Field(default=4, ge=1)
    upload_min_rate: int = Field(default=16384, ge=0)
    upload_grace_s: float = Field(default=10.0, ge=0)
    upload_idle_s: float = Field(default=30.0, gt=0)
    max_header_bytes: int = Field(default=32768, ge=1024)
    header_timeout_s: float = Field(default=10.0, gt=0)
    max_connections: int = Field(default=256, ge=2)
    jobs_dir: Path | None = None
    job_ttl_s: float = Field(default=86400.0, gt=0)
    job_lease_s: float = Field(default=30.0, gt=0)
    job_scan_s: float = Field(default=1.0, gt=0)
    web_dir: Path | None = None
    dask_scheduler: Annotated[str | None, BeforeValidator(blank_to_none)] = Field(
        default=None,
        description="Dask scheduler address (tcp://host:8786, or local:N) for jobs above dask_min_voxels; "
        "unset: every job runs in process",
    )
    dask_min_voxels: int = Field(
        default=64_000_000,
        ge=0,
        description="a job goes to the Dask cluster when its input has more spatial voxels than this",
    )
    dask_workdir: Path | None = Field(
        default=None,
        description="folder for the zarr copies of cluster jobs, seen by every Dask worker at the same path "
        "(default: the job's folder)",
    )
    dicomweb_url: Annotated[str | None, BeforeValidator(blank_to_none)] = Field(
        default=None,
        description="DICOMweb server (its QIDO/WADO/STOW root, e.g. http://pacs:8042/dicom-web) that jobs "
        "given by study and series UID pull from and store their DICOM SEG to; unset: no DICOMweb jobs",
    )
    dicomweb_username: Annotated[str | None, BeforeValidator(blank_to_none)] = Field(
        default=None, description="user name for the DICOMweb server (HTTP basic authentication)"
    )
    dicomweb_password: Annotated[str | None, BeforeValidator(blank_to_none)] = Field(
        default=None, description="password for the DICOMweb server", repr=False
    )

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


def open_repository(settings: Settings) -> ModelRepository:
    """The model repository that ``settings`` describe, not warmed up: the server's, ``tilewise
    infer``'s and ``tilewise plan``'s (``models_dir`` plus ``user_models_dir``, ``device``,
    ``strict_models``, ``measurements_dir``).

    Raises:
        ModelError: with ``strict_models``, a model that fails to load.
    """
    from models import ModelRepository

    return ModelRepository(
        settings.models_dir,
        device=settings.device,
        strict=settings.strict_models,
        measurements_dir=settings.measurements_dir,
        user_models_dir=settings.user_models_dir,
    )
