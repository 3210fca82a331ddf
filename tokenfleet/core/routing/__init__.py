"""In-pool routers. Importing this package registers every built-in router."""

from __future__ import annotations

from tokenfleet.core.routing.base import ROUTERS, BaseRouter, Router, TwoPhaseRouter, eligible

__all__ = ["ROUTERS", "BaseRouter", "Router", "TwoPhaseRouter", "eligible", "create_router"]


def _load_builtins() -> None:
    # Imported for their registration side effect.
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        if mod.name != "base":
            importlib.import_module(f"{__name__}.{mod.name}")


def create_router(name: str, **kwargs: object) -> Router:
    return ROUTERS.create(name, **kwargs)


_load_builtins()
