"""Settings of the control plane (flags of `hpservice serve`, or environment variables)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass(frozen=True)
class Principal:
    owner: str
    admin: bool = False


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = field(
        default_factory=lambda: Path(os.environ.get("HPSERVICE_DATA_DIR", "~/.hpservice")).expanduser()
    )
    database_url: str | None = field(default_factory=lambda: os.environ.get("HPSERVICE_DATABASE_URL"))
    ray_address: str | None = field(default_factory=lambda: os.environ.get("RAY_ADDRESS"))
    tokens: dict[str, Principal] = field(default_factory=dict)
    poll_interval_s: float = 0.5
    dashboard_url: str | None = None

    @property
    def db_url(self) -> str:
        if self.database_url:
            return self.database_url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{self.data_dir / 'hpservice.db'}"

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tokens)

    def check_bind(self) -> None:
        """Without tokens the API is open: it may only listen on loopback."""
        if self.auth_enabled:
            return
        try:
            loopback = self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(
                f"refusing to bind {self.host}: no API tokens are configured (set --tokens-file or HPSERVICE_TOKENS), "
                "so only loopback addresses are allowed"
            )


def load_tokens(tokens_file: str | None = None, env: str | None = None) -> dict[str, Principal]:
    """Tokens from a YAML file ``{TOKEN: {owner: alice, admin: false}}`` and/or ``TOKEN=owner[:admin],...``."""
    tokens: dict[str, Principal] = {}
    if tokens_file:
        data = yaml.safe_load(Path(tokens_file).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{tokens_file}: expected a mapping of token -> {{owner, admin}}")
        for token, entry in data.items():
            if not isinstance(entry, dict) or "owner" not in entry:
                raise ValueError(f"{tokens_file}: token entries need an owner")
            tokens[str(token)] = Principal(str(entry["owner"]), bool(entry.get("admin", False)))
    env = env if env is not None else os.environ.get("HPSERVICE_TOKENS", "")
    for item in filter(None, (part.strip() for part in env.split(","))):
        token, sep, who = item.partition("=")
        if not sep or not token or not who:
            raise ValueError(f"HPSERVICE_TOKENS: expected TOKEN=owner[:admin], got {item!r}")
        owner, _, flag = who.partition(":")
        tokens[token] = Principal(owner, flag == "admin")
    return tokens
