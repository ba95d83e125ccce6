"""Property-based fuzzing of the API from its own OpenAPI schema: no 5xx, no schema violations."""

import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from hpservice.api import Settings, create_app
from hpservice.api.settings import Principal

_APP = create_app(
    Settings(data_dir=Path(tempfile.mkdtemp(prefix="hpservice-fuzz-")), tokens={"t": Principal("alice")}),
    connect_ray=False,
    supervise=False,
)
schema = schemathesis.openapi.from_asgi("/openapi.json", _APP)


# /events is an endless stream and /readyz is 503 without Ray by design: the other tests cover them.
@schema.exclude(path_regex=r".*/events$|^/readyz$").parametrize()
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_api_fuzz(case):
    case.call_and_validate(
        headers={"Authorization": "Bearer t"},
        # Opaque cursors and spec cross-field rules cannot be written in OpenAPI, so a schema-valid
        # request may rightly be rejected (4xx); Starlette's 405 lists only the first matching
        # route's methods in Allow. Everything else is checked, 5xx and schema conformance included.
        excluded_checks=[checks.positive_data_acceptance, checks.unsupported_method, checks.allow_header_conformance],
    )
