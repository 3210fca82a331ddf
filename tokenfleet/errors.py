"""One error hierarchy for TokenFleet.

Every message says what was wrong *and* how to fix it, because these errors
surface on the CLI (one line, exit code 2) and in the HTTP API (OpenAI error
shape) where the user has nothing else to go on.
"""

from __future__ import annotations


class TokenFleetError(Exception):
    """Base class: anything TokenFleet raises on purpose."""

    #: exit code the CLI uses for this error class
    exit_code = 2


class ConfigError(TokenFleetError):
    """A configuration file, flag or value is invalid."""


class ValidationError(ConfigError):
    """A structured document (topology, SLO file, workload) has a bad field."""

    def __init__(self, source: str, field: str, problem: str) -> None:
        self.source = source
        self.field = field
        self.problem = problem
        super().__init__(f"{source}: field '{field}': {problem}")


class TraceFormatError(TokenFleetError):
    """A trace file has a line that cannot be parsed."""

    def __init__(self, path: str, line_no: int, problem: str) -> None:
        self.path = path
        self.line_no = line_no
        self.problem = problem
        super().__init__(f"{path}:{line_no}: {problem}")


class RegistryError(TokenFleetError):
    """Base for name-registry problems."""


class DuplicateNameError(RegistryError):
    """Two implementations tried to register under the same name."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(
            f"{kind} '{name}' is already registered; pick a different name "
            f"or unregister the existing {kind} first"
        )


class UnknownNameError(RegistryError):
    """A name was looked up that nobody registered."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind = kind
        self.name = name
        self.known = known
        choices = ", ".join(sorted(known)) or "(none registered)"
        super().__init__(f"unknown {kind} '{name}'; choose one of: {choices}")


class NoCandidateError(TokenFleetError):
    """A policy found no instance or datacenter that may take the request."""


class CapacityError(TokenFleetError):
    """A request can never fit an instance (prompt + output > KV capacity)."""
