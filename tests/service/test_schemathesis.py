"""Schemathesis over the OpenAPI document, against a real server: no 5xx, and every response
(status, content type, headers, JSON body) conforms to the document. Bounded: a few examples per
operation (``SCHEMATHESIS_EXAMPLES``, default 12), no shrinking deadline."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from _svc_helpers import start_server, stop_server
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = int(os.environ.get("SCHEMATHESIS_EXAMPLES", "12"))


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    server = start_server(
        tmp_path_factory.mktemp("schemathesis"), warmup="false", max_upload_bytes=str(2**20), queue_size="4"
    )
    try:
        yield schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    finally:
        stop_server(server)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def test_api_conforms_to_its_openapi_document(api_schema) -> None:
    """Every operation, ``EXAMPLES`` generated cases each (schemathesis' Python API and
    Hypothesis; its pytest plugin does not run under this pytest)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]  # type: ignore[attr-defined]
    labels = sorted(op.label for op in operations)
    assert "POST /v1/models/{name}/infer" in labels and "GET /v1/models" in labels, labels
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=120)

        check()


def test_the_document_states_the_closed_value_sets(api_schema) -> None:
    raw = api_schema.raw_schema  # type: ignore[attr-defined]
    operation = raw["paths"]["/v1/models/{name}/infer"]["post"]
    enums = {p["name"]: p["schema"].get("enum") for p in operation["parameters"] if p["in"] == "query"}
    for name in ("format", "blend", "output", "tta"):
        assert enums[name], name
    for status in ("400", "404", "408", "413", "415", "422", "503"):
        assert "schema" in operation["responses"][status]["content"]["application/json"], status
    assert Path(__file__).name == "test_schemathesis.py"
