"""Schemathesis over the OpenAPI document, against a real server with an API key: every check
schemathesis has (``--checks all``: no 5xx, status codes, content types, headers and bodies as
documented, ``Allow`` on 405, schema-valid data accepted and schema-violating data refused, auth
not ignored), in positive and negative generation. Bounded: a few examples per operation and mode
(``SCHEMATHESIS_EXAMPLES``, default 6); ``test_api_conforms_at_length`` (slow) runs 60.

Schema-valid data may still be refused for what a schema cannot say: the file's size (413), its
format (415), its dimensionality for the model (422), or a per-axis parameter with another number
of axes than the input (400); ``positive_data_acceptance`` accepts those.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from _svc_helpers import start_server, stop_server
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS
from schemathesis.config import SchemathesisConfig

EXAMPLES = int(os.environ.get("SCHEMATHESIS_EXAMPLES", "6"))
KEY = "schemathesis-key-0123456789"

CONFIG = f"""
[auth.openapi.HTTPBearer]
bearer = "{KEY}"

[checks.positive_data_acceptance]
expected-statuses = ["2xx", "3xx", "400", "401", "403", "404", "409", "413", "415", "422", "429", "5xx"]
"""


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    server = start_server(
        tmp_path_factory.mktemp("schemathesis"),
        warmup="false",
        max_upload_bytes=str(2**20),
        queue_size="4",
        api_key=KEY,
    )
    try:
        yield schemathesis.openapi.from_url(
            f"{server.url}/openapi.json", config=SchemathesisConfig.from_str(CONFIG)
        )
    finally:
        stop_server(server)


def _run_all(api_schema, examples: int) -> None:
    checks = CHECKS.get_all()
    assert len(checks) >= 10, [c.__name__ for c in checks]
    operations = [result.ok() for result in api_schema.get_all_operations()]  # type: ignore[attr-defined]
    labels = sorted(op.label for op in operations)
    assert "POST /v1/models/{name}/infer" in labels and "DELETE /v1/jobs/{job_id}" in labels, labels
    statuses: dict[GenerationMode, list[int]] = {GenerationMode.POSITIVE: [], GenerationMode.NEGATIVE: []}
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                deadline=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            def check(case) -> None:
                response = case.call_and_validate(checks=checks, timeout=120)
                statuses[case.meta.generation.mode].append(response.status_code)

            try:
                check()
            except Unsatisfiable:  # nothing to make invalid (no parameter, no body)
                assert mode is GenerationMode.NEGATIVE and not operation.query and not operation.body, (
                    operation.label
                )
    # The key is sent (schemathesis' auth config): valid requests are never 401, and some succeed.
    valid = statuses[GenerationMode.POSITIVE]
    assert 401 not in valid and {200, 202} & set(valid), sorted(set(valid))


def test_api_conforms_to_its_openapi_document(api_schema) -> None:
    """Every operation, ``EXAMPLES`` generated cases per generation mode, every check
    (schemathesis' Python API and Hypothesis; its pytest plugin does not run under this pytest)."""
    _run_all(api_schema, EXAMPLES)


@pytest.mark.slow
def test_api_conforms_at_length(api_schema) -> None:
    _run_all(api_schema, 60)


def test_the_document_states_the_closed_value_sets(api_schema) -> None:
    raw = api_schema.raw_schema  # type: ignore[attr-defined]
    operation = raw["paths"]["/v1/models/{name}/infer"]["post"]
    schemas = {p["name"]: p["schema"] for p in operation["parameters"] if p["in"] == "query"}
    for name in ("format", "blend", "output", "tta"):
        assert schemas[name]["enum"][0] == "" and len(schemas[name]["enum"]) > 2, name
    for status in ("400", "401", "403", "404", "408", "413", "415", "422", "503"):
        assert "schema" in operation["responses"][status]["content"]["application/json"], status
    # Numbers are typed as numbers, and a job never takes dry_run.
    assert {"type": "integer", "minimum": 1} in schemas["batch_size"]["anyOf"]
    assert {"type": "boolean"} in schemas["dry_run"]["anyOf"]
    submit = raw["paths"]["/v1/jobs"]["post"]
    assert "dry_run" not in {p["name"] for p in submit["parameters"]}
    for status in ("401", "408", "415", "422"):
        assert status in submit["responses"], status
    assert "400" in raw["paths"]["/v1/jobs"]["get"]["responses"]  # limit=0
    result = raw["paths"]["/v1/jobs/{job_id}/result"]["get"]["responses"]["200"]["content"]
    assert {"application/gzip", "image/png", "image/tiff"} <= set(result)
    assert Path(__file__).name == "test_schemathesis.py"
