"""The configuration, layered like Flask's: defaults < file < environment < overrides.

Every knob of TokenFleet's service processes is here, in one flat namespace so
the API, workers, beat and CLI agree on names: the stores, ports and ledger
(:class:`ServiceConfig`) and the live request path (routing, admission,
timeouts, control loop: :class:`tokenfleet.live.config.LiveConfig`, loaded
in the same layers into ``ServiceConfig.live``). Each field carries a
one-line doc in its metadata; its environment variable is ``TOKENFLEET_`` +
its upper-case name. :func:`config_reference_markdown` renders the table that
docs/deployment.md embeds, and a test keeps the two identical.

The file is TOML or YAML (chosen by suffix) with the same flat keys, e.g.::

    redis_url = "redis://127.0.0.1:6379/0"
    ledger_batch_size = 1000
    router = "tokenpilot"

Unknown keys are errors, not silently ignored, because a typo in a deployment
file otherwise shows up as "the setting did nothing".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tokenfleet.errors import ConfigError
from tokenfleet.live.config import LiveConfig

ENV_PREFIX = "TOKENFLEET_"
CONFIG_ENV = "TOKENFLEET_CONFIG"

#: where a value came from, for ``tokenfleet services config``
Source = str


def _key(doc: str, *, secret: bool = False) -> dict[str, Any]:
    return {"doc": doc, "secret": secret}


@dataclass(frozen=True)
class ServiceConfig:
    """Every setting the live service reads. Env var = ``TOKENFLEET_`` + upper-case name."""

    data_dir: Path = field(
        default=Path(".tokenfleet"),
        metadata=_key(
            "Directory for embedded Redis/PostgreSQL data, pid/state files and the "
            "ledger spill files. Relative paths are resolved against the working directory."
        ),
    )
    redis_url: str | None = field(
        default=None,
        metadata=_key(
            "External Redis (`redis://host:port/db`). Unset: TokenFleet starts an "
            "embedded Redis under `data_dir`.",
            secret=True,
        ),
    )
    database_url: str | None = field(
        default=None,
        metadata=_key(
            "External PostgreSQL (`postgresql://user:pw@host:port/db`; the "
            "`+psycopg` driver is added if missing). Unset: embedded PostgreSQL under `data_dir`.",
            secret=True,
        ),
    )
    broker_url: str | None = field(
        default=None,
        metadata=_key("Celery broker. Unset: `redis_url` with database 0.", secret=True),
    )
    api_key: str | None = field(
        default=None,
        metadata=_key(
            "Bootstrap admin API key accepted by the HTTP API in addition to the "
            "hashed keys in the `api_keys` table. Unset: no admin key.",
            secret=True,
        ),
    )
    api_host: str = field(default="127.0.0.1", metadata=_key("Address the HTTP API binds to."))
    api_port: int = field(default=8000, metadata=_key("Port the HTTP API binds to."))
    log_level: str = field(
        default="INFO", metadata=_key("Python logging level for service processes.")
    )
    log_format: str = field(
        default="text",
        metadata=_key(
            'Log lines of api, worker and beat: "text", or "json" (one object per line, the '
            "access log's fields as keys; `tokenfleet up --log-format`)."
        ),
    )
    embedded_redis_port: int = field(
        default=0,
        metadata=_key("TCP port of the embedded Redis; 0 picks a free port on 127.0.0.1."),
    )
    embedded_postgres_port: int = field(
        default=0,
        metadata=_key("TCP port of the embedded PostgreSQL; 0 picks a free port on 127.0.0.1."),
    )
    embedded_postgres_user: str = field(
        default="embedded_postgres",
        metadata=_key(
            "System user that runs the embedded PostgreSQL when TokenFleet runs as "
            "root (PostgreSQL refuses root); created with `useradd` if missing."
        ),
    )
    database_name: str = field(
        default="tokenfleet",
        metadata=_key("Database created inside the embedded PostgreSQL."),
    )
    ledger_batch_size: int = field(
        default=500, metadata=_key("Rows per INSERT .. ON CONFLICT batch of the ledger writer.")
    )
    ledger_flush_interval_s: float = field(
        default=0.25,
        metadata=_key("Longest time a recorded row waits in memory before a flush is attempted."),
    )
    ledger_max_buffer_rows: int = field(
        default=100_000,
        metadata=_key(
            "In-memory rows the ledger writer holds while the database is down; "
            "beyond this, rows go to spill files under `data_dir/spill`."
        ),
    )
    ledger_retry_max_s: float = field(
        default=5.0,
        metadata=_key("Cap of the exponential backoff between retries of a failed ledger flush."),
    )

    #: the live path's knobs, from the same layers (flat keys in files and env)
    live: LiveConfig = field(default_factory=LiveConfig, compare=False)
    # sources are bookkeeping, not settings: excluded from files/env
    sources: Mapping[str, Source] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived values -------------------------------------------------
    def resolved_data_dir(self) -> Path:
        return self.data_dir.expanduser().resolve()

    def effective_broker_url(self, redis_url: str | None = None) -> str | None:
        """Broker URL, falling back to database 0 of ``redis_url``."""
        if self.broker_url:
            return self.broker_url
        base = redis_url or self.redis_url
        return with_redis_db(base, 0) if base else None

    def redacted(self) -> dict[str, str]:
        """Values for display (live knobs included): secrets masked, URL passwords hidden."""
        out: dict[str, str] = {}
        for f in setting_fields() + live_fields():
            value = getattr(self.live if f in _LIVE_FIELDS else self, f.name)
            text = "" if value is None else str(value)
            if value is not None and f.metadata.get("secret"):
                text = redact_url(text) if "://" in text else "****"
            out[f.name] = text
        return out


def setting_fields() -> list[dataclasses.Field[Any]]:
    """The service's own keys (stores, ports, ledger)."""
    return [f for f in dataclasses.fields(ServiceConfig) if f.name not in ("sources", "live")]


_LIVE_FIELDS = dataclasses.fields(LiveConfig)


def live_fields() -> list[dataclasses.Field[Any]]:
    """The live path's keys (:class:`LiveConfig`)."""
    return list(_LIVE_FIELDS)


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


_TYPE_HINTS: dict[str, Any] = {}


def _field_type(name: str) -> tuple[type, bool]:
    """(base type, optional?) of a config field, from its annotation."""
    if not _TYPE_HINTS:
        _TYPE_HINTS.update(typing.get_type_hints(LiveConfig))
        _TYPE_HINTS.update(typing.get_type_hints(ServiceConfig))
    hint = _TYPE_HINTS[name]
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    return hint, optional


def _coerce(name: str, raw: object, origin: str) -> object:
    base, optional = _field_type(name)
    if raw is None or (optional and isinstance(raw, str) and raw.strip() == ""):
        if optional:
            return None
        raise ConfigError(f"{origin}: '{name}' may not be empty; remove it to use the default")
    try:
        if base is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if base is int:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return int(str(raw).strip())
        if base is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(str(raw).strip())
        if base is Path:
            return Path(str(raw))
        if base is str:
            if not isinstance(raw, (str, int, float)):
                raise ValueError(raw)
            return str(raw)
    except ValueError:
        raise ConfigError(f"{origin}: '{name}' must be a {base.__name__}, got {raw!r}") from None
    raise AssertionError(f"unsupported config type {base!r}")  # pragma: no cover


def read_config_file(path: Path) -> dict[str, object]:
    """Parse a TOML (.toml) or YAML (.yaml/.yml) file into a flat dict."""
    if not path.is_file():
        raise ConfigError(
            f"config file {path} does not exist; fix --config / {CONFIG_ENV} or create the file"
        )
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data: object = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(
                f"config file {path}: unknown format '{suffix}'; use .toml, .yaml or .yml"
            )
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path} is not valid {suffix[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a table/mapping of keys")
    return {str(k): v for k, v in data.items()}


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> ServiceConfig:
    """Build the config: defaults < file (``path`` or $TOKENFLEET_CONFIG) < env < overrides.

    ``env`` defaults to ``os.environ``; tests pass a dict to stay hermetic.
    ``overrides`` entries whose value is ``None`` are ignored, so CLI flags that
    were not given can be passed straight through.
    """
    environ = os.environ if env is None else env
    own = {f.name for f in setting_fields()}
    live_names = {f.name for f in live_fields()}
    names = own | live_names
    values: dict[str, object] = {}
    sources: dict[str, Source] = {name: "default" for name in sorted(names)}

    file_path = path if path is not None else environ.get(CONFIG_ENV) or None
    if file_path is not None:
        fp = Path(file_path).expanduser()
        for key, raw in read_config_file(fp).items():
            if key not in names:
                raise ConfigError(
                    f"config file {fp}: unknown key '{key}'; valid keys: {', '.join(sorted(names))}"
                )
            values[key] = _coerce(key, raw, f"config file {fp}")
            sources[key] = f"file:{fp}"

    for name in names:
        var = env_var(name)
        if var in environ:
            values[name] = _coerce(name, environ[var], f"environment {var}")
            sources[name] = f"env:{var}"

    for key, raw in (overrides or {}).items():
        if raw is None:
            continue
        if key not in names:
            raise ConfigError(f"unknown config key '{key}'; valid keys: {', '.join(sorted(names))}")
        values[key] = _coerce(key, raw, "override")
        sources[key] = "override"

    live = LiveConfig(**{k: v for k, v in values.items() if k in live_names})  # type: ignore[arg-type]
    live.validate()
    cfg = ServiceConfig(
        **{k: v for k, v in values.items() if k in own},  # type: ignore[arg-type]
        live=live,
        sources=sources,
    )
    _validate(cfg)
    return cfg


def _validate(cfg: ServiceConfig) -> None:
    for name in ("api_port", "embedded_redis_port", "embedded_postgres_port"):
        port = getattr(cfg, name)
        if not 0 <= port <= 65535:
            raise ConfigError(f"'{name}' must be a TCP port 0..65535, got {port}")
    if cfg.ledger_batch_size < 1:
        raise ConfigError("'ledger_batch_size' must be >= 1")
    if cfg.ledger_flush_interval_s <= 0:
        raise ConfigError("'ledger_flush_interval_s' must be > 0 seconds")
    if cfg.ledger_max_buffer_rows < cfg.ledger_batch_size:
        raise ConfigError("'ledger_max_buffer_rows' must be >= 'ledger_batch_size'")
    for name in ("redis_url", "broker_url"):
        url = getattr(cfg, name)
        if url and not re.match(r"^(redis|rediss|unix|amqp|amqps|memory)://", url):
            raise ConfigError(
                f"'{name}' = {redact_url(url)} is not a broker URL; use redis://host:port/db"
            )
    if cfg.database_url and not cfg.database_url.startswith(("postgresql", "postgres", "sqlite")):
        raise ConfigError(
            f"'database_url' = {redact_url(cfg.database_url)} is not supported; "
            "use postgresql://user:password@host:port/dbname"
        )


# ---- URL helpers ----------------------------------------------------------
def redact_url(url: str) -> str:
    """Hide the password part of ``scheme://user:password@host``."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:****@", url)


def with_redis_db(url: str, db: int) -> str:
    """Same Redis server, another logical database number."""
    m = re.match(r"^(rediss?://[^/?#]*)(/\d*)?(.*)$", url)
    if not m:
        return url
    return f"{m.group(1)}/{db}{m.group(3)}"


# ---- CLI glue ---------------------------------------------------------------
def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and ``--data-dir``, shared by every service subcommand."""
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help=f"TOML or YAML config file (default: ${CONFIG_ENV})",
    )
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        default=None,
        help="directory for embedded services and spill files (default: ./.tokenfleet)",
    )


def config_from_args(args: argparse.Namespace, **extra: object) -> ServiceConfig:
    """Config from ``--config``/``--data-dir`` plus any extra explicit overrides."""
    overrides: dict[str, object] = {"data_dir": getattr(args, "data_dir", None)}
    overrides.update(extra)
    return load_config(getattr(args, "config", None), overrides=overrides)


def config_reference_markdown() -> str:
    """The key tables of docs/deployment.md, generated so the doc cannot drift."""
    out = []
    for title, fields in (
        ("Stores, ports and the ledger", setting_fields()),
        ("The live request path", live_fields()),
    ):
        lines = [
            f"**{title}**",
            "",
            "| key | environment variable | type | default | meaning |",
            "| --- | --- | --- | --- | --- |",
        ]
        for f in fields:
            base, optional = _field_type(f.name)
            type_name = ("path" if base is Path else base.__name__) + (
                " or unset" if optional else ""
            )
            default = f.default
            default_text = "unset" if default is None else f"`{default}`"
            if default == "":
                default_text = "empty"
            lines.append(
                f"| `{f.name}` | `{env_var(f.name)}` | {type_name} | {default_text} "
                f"| {f.metadata['doc']} |"
            )
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)
