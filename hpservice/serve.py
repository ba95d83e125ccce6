"""``hpservice serve``: the REST control plane under uvicorn."""

from __future__ import annotations

import sys
from pathlib import Path


def serve(
    host: str,
    port: int,
    data_dir: str | None,
    ray_address: str | None,
    tokens_file: str | None,
    *,
    allow_models: list[str] = (),
    data_roots: list[str] = (),
    docs: bool = True,
) -> int:
    import uvicorn

    from api import Settings, create_app
    from api.logs import redact_tokens
    from api.settings import load_tokens

    settings = Settings(host=host, port=port, docs=docs)
    settings.model_factories = (*settings.model_factories, *allow_models)
    settings.data_roots = (*settings.data_roots, *(Path(p).expanduser() for p in data_roots))
    if data_dir:
        settings.data_dir = Path(data_dir).expanduser()
    if ray_address:
        settings.ray_address = ray_address
    try:
        settings.tokens = load_tokens(tokens_file)
        settings.check_bind()
    except (ValueError, OSError) as e:
        print(f"hpservice serve: {e}", file=sys.stderr)
        return 2
    if not settings.auth_enabled:
        print(
            f"hpservice serve: no API tokens configured: open API, listening on loopback only ({host})", file=sys.stderr
        )
    app = create_app(settings)
    redact_tokens()
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    return 0
