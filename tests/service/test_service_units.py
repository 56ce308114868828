"""Service units without a server: parameters, settings, the error mapping, the executor."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time

import pytest
from pydantic import ValidationError

import service.errors as service_errors
from models.errors import ParamError
from models.planning.params import InferenceParams, parse_params
from service.errors import NotReadyError, QueueFullError, ServiceError
from service.executor import DeviceExecutor

# -- parameters -----------------------------------------------------------------------------------


def test_parse_params_values() -> None:
    params = parse_params(
        {
            "tile": "128,128,64",
            "halo": "auto",
            "overlap": "4",
            "blend": "HANN",
            "batch_size": "2",
            "output": "labels",
            "format": ".NII.GZ",
            "halo_tolerance": "1e-3",
        }  # fmt: skip
    )
    assert params == InferenceParams(
        tile=(128, 128, 64), halo="auto", halo_tolerance=1e-3, overlap=4, blend="hann", batch_size=2,
        output="labels", format="nii.gz",
    )  # fmt: skip
    assert params.to_query()["tile"] == "128,128,64" and params.to_query()["format"] == "nii.gz"
    assert parse_params(params.to_query()) == params  # the query form round-trips
    assert parse_params({"halo": "8,0", "tile": " ", "blend": None}) == InferenceParams(halo=(8, 0))


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        pytest.param({"tile": "0"}, "tile=0 must be >= 1", id="tile-0"),
        pytest.param({"tile": "64,0"}, "tile[1]=0", id="tile-axis-0"),
        pytest.param({"halo": "-1"}, "halo=-1 must be >= 0", id="halo-negative"),
        pytest.param({"tile": "abc"}, "not an integer", id="tile-text"),
        pytest.param({"overlap": "-2"}, "overlap=-2", id="overlap-negative"),
        pytest.param({"batch_size": "0"}, "batch_size=0", id="batch-0"),
        pytest.param({"batch_size": "2,2"}, "one integer", id="batch-tuple"),
        pytest.param({"blend": "cosine"}, "blend='cosine'", id="blend"),
        pytest.param({"blend": "han"}, "did you mean 'hann'", id="blend-did-you-mean"),
        pytest.param({"output": "logits"}, "output='logits'", id="output"),
        pytest.param({"format": "jpeg"}, "format='jpeg'", id="format"),
        pytest.param({"halo_tolerance": "0"}, "halo_tolerance", id="tolerance-0"),
        pytest.param({"halo_tolerance": "nan"}, "halo_tolerance", id="tolerance-nan"),
        pytest.param({"tiles": "64"}, "unknown parameter.*did you mean 'tile'", id="typo"),
    ],
)
def test_parse_params_errors(raw: dict[str, str], fragment: str) -> None:
    with pytest.raises(ParamError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        parse_params(raw)


def test_option_lists_match_the_engine_and_the_codecs() -> None:
    """models.planning.params is light (the client may not import torch), so it spells the blend names out;
    they must stay the values of tiling.BlendMode, and the formats those the codecs write."""
    from models.planning.params import Blend, OutputFormat
    from service.codecs import OUTPUT_FORMATS
    from service.options import FORMAT_SUFFIXES
    from tiling import BlendMode

    assert [b.value for b in Blend] == [mode.value for mode in BlendMode]
    suffixes = {f.value: "." + f.value for f in OutputFormat}
    suffixes |= {"dicom-seg": ".dcm", "ome.zarr": ".ome.zarr.zip"}
    assert FORMAT_SUFFIXES == OUTPUT_FORMATS == suffixes


def test_cli_options_come_from_the_schema() -> None:
    """Every InferenceParams field is a ``--name`` option of ``tilewise infer``, ``tilewise batch``
    and ``tilewise plan``, but the request-only ones (``dry_run``: ``tilewise plan`` is the CLI's)."""
    from models.planning.params import REQUEST_ONLY
    from service.cli import build_parser

    parser = build_parser()
    fields = [name for name in InferenceParams.model_fields if name not in REQUEST_ONLY]
    assert fields and "dry_run" in REQUEST_ONLY
    for command in ("infer", "batch", "plan"):
        args = ["in", *(["out"] if command != "plan" else []), "--model", "m"]
        for name in fields:
            choices = InferenceParams.choices(name)
            args += [f"--{name.replace('_', '-')}", choices[0] if choices else "1"]
        parsed = parser.parse_args([command, *args])
        given = {k[len("param_") :]: v for k, v in vars(parsed).items() if k.startswith("param_")}
        assert set(given) == set(fields), command
        with pytest.raises(SystemExit):
            parser.parse_args([command, *args, "--dry-run", "true"])


def test_argparse_number() -> None:
    import argparse

    from service.options import argparse_number

    count, seconds = argparse_number(int, 0), argparse_number(float, 0.0, strict=True)
    assert count("3") == 3 and seconds("0.5") == 0.5
    for parse, text, message in (
        (count, "-1", "-1 must be >= 0"),
        (count, "1.5", "'1.5' is not an integer"),
        (seconds, "0", "0.0 must be > 0.0"),
        (seconds, "nan", "nan must be > 0.0"),
        (seconds, "x", "'x' is not a number"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


# -- settings -------------------------------------------------------------------------------------


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch, make_settings) -> None:
    monkeypatch.setenv("TILEWISE_QUEUE_SIZE", "3")
    monkeypatch.setenv("TILEWISE_MAX_UPLOAD_BYTES", "1000")
    monkeypatch.setenv("TILEWISE_API_KEY", "s3cr3t-value")
    monkeypatch.setenv("TILEWISE_DEVICE", "cuda:1")
    settings = make_settings()
    assert settings.queue_size == 3 and settings.max_upload_bytes == 1000
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "s3cr3t-value"
    assert settings.device == "cuda:1"
    assert "s3cr3t-value" not in repr(settings)
    with pytest.raises(ValidationError):
        settings.queue_size = 5  # frozen


def test_settings_validation(monkeypatch: pytest.MonkeyPatch, make_settings) -> None:
    assert make_settings().device is None and make_settings().api_key is None
    monkeypatch.setenv("TILEWISE_API_KEY", "")
    assert make_settings().api_key is None
    for bad in ({"device": "tpu"}, {"queue_size": -1}, {"max_upload_bytes": 0}, {"max_voxel": 5}):
        with pytest.raises(ValidationError):
            make_settings(**bad)


def test_serve_has_an_option_for_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from service.commands import serve
    from service.settings import Settings

    sub = argparse.ArgumentParser().add_subparsers()
    serve.register(sub)
    parser = sub.choices["serve"]
    assert set(Settings.model_fields) <= {action.dest for action in parser._actions}
    assert Settings().graceful_shutdown_s == 120
    monkeypatch.setenv("TILEWISE_QUEUE_SIZE", "5")
    monkeypatch.setenv("TILEWISE_API_KEY", "from-the-environment")
    options = "--api-key k3y --graceful-shutdown 7 --max-voxels 10 --no-warmup --tmp-dir /t"
    args = parser.parse_args(options.split())
    settings = serve.settings_from_args(args)
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "k3y"  # option wins
    assert settings.graceful_shutdown_s == 7 and settings.max_voxels == 10 and settings.warmup is False
    assert str(settings.tmp_dir) == "/t" and settings.queue_size == 5  # the variable where no option
    monkeypatch.setenv("TILEWISE_GRACEFUL_SHUTDOWN_S", "30")
    assert serve.settings_from_args(parser.parse_args([])).graceful_shutdown_s == 30
    with pytest.raises(SystemExit):
        parser.parse_args(["--queue-size", "-1"])


def test_dotenv_counts_only_tilewise_keys_and_refuses_typos(tmp_path) -> None:
    from service.settings import Settings

    env = tmp_path / ".env"
    env.write_text("COMPOSE_PROJECT_NAME=x\nTILEWISE_QUEUE_SIZE=3\n", encoding="utf-8")
    assert Settings(_env_file=env).queue_size == 3
    env.write_text("TILEWISE_QUEUE_SIZ=3\n", encoding="utf-8")
    with pytest.raises(ValidationError, match="queue_siz"):
        Settings(_env_file=env)


# -- errors ---------------------------------------------------------------------------------------


def _public_errors(module: object) -> list[type[BaseException]]:
    return [obj for _, obj in inspect.getmembers(module, inspect.isclass) if issubclass(obj, Exception)]


def test_every_public_exception_has_an_http_mapping() -> None:
    """Meta-test: each exception of service, models and tiling maps to its documented status."""
    from models import errors as model_errors
    from service.http_errors import classify
    from tiling import errors as tiling_errors

    expected = {
        "ServiceError": 500, "BadParameterError": 400, "EmptyBodyError": 400, "AuthenticationError": 401,
        "UnsupportedMediaTypeError": 415, "DecodeError": 422, "UnusableInputError": 422,
        "PayloadTooLargeError": 413, "QueueFullError": 503, "ParamError": 400,
        "NotReadyError": 503, "ModelError": 500, "UnknownModelError": 404, "RegistryError": 500,
        "SpecError": 500, "InputError": 422, "WeightsError": 500, "ChecksumMismatchError": 500,
        "IncompatibleWeightsError": 500, "BackendError": 500, "BackendUnavailableError": 503,
        "InferenceError": 500, "DeviceOutOfMemoryError": 503, "ExportError": 500,
        "ImportRefusedError": 500, "ModelUnavailableError": 503, "TilingError": 500,
        "GridError": 400, "ShapeMismatchError": 500, "CoverageError": 500, "AccumulatorStateError": 500,
        "OverBudgetError": 422, "MemoryBudgetError": 413, "UploadTimeoutError": 408, "RunCancelledError": 503,
        "JobNotFoundError": 404, "JobStateError": 409, "IdempotencyKeyReusedError": 409,
        "DistributedError": 422, "TileDependentError": 422, "ClusterUnavailableError": 503,
        "InsufficientStorageError": 507,
        "ForbiddenError": 403, "CrossOriginError": 403, "BadHostError": 400,
        "DicomSeriesError": 422,
    }  # fmt: skip
    classes = [*_public_errors(service_errors), *_public_errors(model_errors), *_public_errors(tiling_errors)]
    assert {c.__name__ for c in classes} == set(expected)
    for cls in classes:
        exc = cls("boom") if cls is not QueueFullError else cls("boom", retry_after_s=4)
        info = classify(exc)
        assert info.status == expected[cls.__name__], cls
        if info.status == 503:
            assert int(info.headers["Retry-After"]) >= 0
        if info.status == 500:
            assert "boom" not in info.detail  # no internals to clients
        else:
            assert info.detail
    assert classify(ValueError("x")).status == 500
    assert all(issubclass(c, ServiceError) for c in _public_errors(service_errors))


def test_service_errors_module_is_light() -> None:
    """service.errors, models.planning.params and the codecs never import torch or FastAPI."""
    import subprocess
    import sys

    code = (
        "import sys, service.errors, models.planning.params, models.spec, service.codecs, service.options;"
        "bad = [m for m in ('torch', 'fastapi', 'starlette') if m in sys.modules];"
        "print(*bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# -- executor -------------------------------------------------------------------------------------


def test_executor_bounds_its_queue_and_runs_in_order() -> None:
    depths: list[int] = []
    gate = threading.Event()
    done: list[int] = []
    executor = DeviceExecutor("cpu", 2, retry_after_s=7, on_depth=depths.append)
    try:

        def job(i: int) -> int:
            gate.wait(10)
            done.append(i)
            return i * 10

        first = executor.submit_future(lambda: job(0))
        deadline = time.monotonic() + 5
        while (executor.depth != 1 or executor._jobs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert executor.depth == 1 and not executor._jobs  # the first job runs, none waits
        queued = [executor.submit_future(lambda i=i: job(i)) for i in (1, 2)]
        assert not executor.has_room()
        with pytest.raises(QueueFullError) as info:
            executor.submit_future(lambda: job(3))
        assert info.value.retry_after_s == 7
        gate.set()
        assert [f.result(10) for f in (first, *queued)] == [0, 10, 20]
        assert done == [0, 1, 2] and max(depths) == 3 and depths[-1] == 0
    finally:
        executor.shutdown()


def test_cancelled_waiting_job_frees_its_slot() -> None:
    gate = threading.Event()
    executor = DeviceExecutor("cpu", 1)
    try:
        running = executor.submit_future(lambda: gate.wait(10))
        deadline = time.monotonic() + 5
        while executor._running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert executor._running == 1
        waiting = executor.submit_future(lambda: "never")
        assert not executor.has_room()
        assert waiting.cancel()
        assert executor.has_room() and executor.depth == 1
        again = executor.submit_future(lambda: "ran")
        gate.set()
        assert running.result(10) is True and again.result(10) == "ran"
    finally:
        executor.shutdown()


def test_reserved_slots_bound_the_queue_until_used_or_released() -> None:
    depths: list[int] = []
    executor = DeviceExecutor("cpu", 1, retry_after_s=4, on_depth=depths.append)
    try:
        first, second = executor.reserve(), executor.reserve()  # one to run, one to wait
        assert executor.depth == 2 and not executor.has_room()
        with pytest.raises(QueueFullError) as info:
            executor.reserve()
        assert info.value.retry_after_s == 4
        with pytest.raises(QueueFullError):
            executor.submit_future(lambda: 0)  # a job without a slot needs a free one too
        second.release()
        second.release()  # idempotent
        assert executor.depth == 1 and executor.has_room()
        assert executor.submit_future(lambda: 42, slot=first).result(10) == 42
        first.release()  # consumed by the job: a no-op
        with pytest.raises(RuntimeError):
            executor.submit_future(lambda: 0, slot=first)  # a slot serves one job
        deadline = time.monotonic() + 5
        while executor.depth and time.monotonic() < deadline:
            time.sleep(0.01)
        assert executor.depth == 0 and depths[:3] == [1, 2, 1] and depths[-1] == 0
    finally:
        executor.shutdown()
    with pytest.raises(NotReadyError):
        executor.reserve()


def test_executor_run_is_awaitable_and_propagates_errors() -> None:
    executor = DeviceExecutor("cpu", 1)

    def fail() -> None:
        raise ValueError("bad input")

    async def main() -> tuple[int, str]:
        value = await executor.run(lambda: 41 + 1)
        try:
            await executor.run(fail)
        except ValueError as exc:
            return value, str(exc)
        return value, ""

    try:
        assert asyncio.run(main()) == (42, "bad input")
    finally:
        executor.shutdown()
    with pytest.raises(RuntimeError):
        executor.submit_future(lambda: None)
