"""Name registries: policies are found by name, never by import path.

Registering a name twice is an error rather than a silent override, so two
plugins cannot shadow each other without anyone noticing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from tokenfleet.errors import DuplicateNameError, UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories for one kind of policy."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Class decorator: ``@ROUTERS.register("round_robin")``."""

        def decorator(factory: Callable[..., T]) -> Callable[..., T]:
            self.add(name, factory)
            return factory

        return decorator

    def add(self, name: str, factory: Callable[..., T]) -> None:
        if name in self._factories:
            raise DuplicateNameError(self.kind, name)
        self._factories[name] = factory

    def remove(self, name: str) -> None:
        if name not in self._factories:
            raise UnknownNameError(self.kind, name, self.names())
        del self._factories[name]

    def get(self, name: str) -> Callable[..., T]:
        try:
            return self._factories[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self.names()) from None

    def create(self, name: str, **kwargs: object) -> T:
        return self.get(name)(**kwargs)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories
