"""Schemathesis against the served /openapi.json: requests generated from the schema (positive
mode: valid by it) to both POST routes. Every answer is a 2xx or a refusal the schema documents
(404 for another model, 413 above the body limit, a 400 whose code its x-schema-valid-refusals
lists), never a 5xx, and every answer matches the schema's response for its status (each event
of a stream too). Bounded: a fixed number of examples per route, derandomized, and a time budget
past which the remaining examples are skipped; the tiny checkpoint with a 256-token context, so
that no request generates much."""
from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_headers_conformance,
                                 response_schema_conformance, status_code_conformance)

from ridge import LLM
from ridge.server.app import create_app
from ridge.server.config import ServerConfig
from tests.server_support import AUTH, KEY, MODEL
from tests.tests_support import serving

EXAMPLES = 60
BUDGET_S = 90                # both routes together, on a 2-core machine
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def schema_server(checkpoints):
    cfg = ServerConfig(model_name=MODEL, api_key=KEY, max_prompts=2, max_stop=2, max_stop_chars=16,
                       max_logprobs=3, max_body_bytes=16 * 1024)
    app = create_app(lambda: LLM(checkpoints("llama"), device="cpu", show_progress=False, max_model_len=256,
                                 kv_cache_memory=8 << 20, max_n=2), cfg)
    with serving(app) as url:
        yield url


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_schema_valid_requests_are_served_as_the_schema_says(schema_server, path):
    url = schema_server
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    op = schema[path]["POST"]
    refusals = set(op.definition.raw["responses"]["400"]["x-schema-valid-refusals"])
    seen: dict[int, int] = {}
    deadline = time.monotonic() + BUDGET_S / 2

    @given(case=op.as_strategy())
    # derandomized: the same examples on every run (a failure reproduces; CI does not flake)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def check(case):
        if time.monotonic() > deadline:
            return
        response = case.call(base_url=url, headers=AUTH, timeout=30)
        case.validate_response(response, checks=CHECKS)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        if response.status_code == 400:
            error = response.json()["error"]
            assert error["code"] in refusals, (case.body, error)
        else:
            assert response.status_code in (200, 404, 413), (case.body, response.text[:300])

    check()
    ran = sum(seen.values())
    assert ran >= EXAMPLES // 6, seen                    # the budget let enough examples run, even under load
    assert seen.get(200, 0) >= ran // 4, seen            # most valid requests are served, not refused
    assert httpx.get(url + "/health").status_code == 200
