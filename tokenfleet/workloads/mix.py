"""Mixed workloads from YAML: several request classes sharing one cluster.

Each class draws requests from a trace file or a synthetic generator and
gives them its own tenant, task type, output budget (``max_tokens``), rate,
client timeout and deadline. Two arrival shapes:

- a stream: the source's own arrival pattern, rescaled to ``rate_rps``
  (or by ``rate_scale``), starting ``start_s`` into the source and cut at
  the mix's ``duration_s``;
- a job: ``at_s`` puts ``count`` requests (after skipping ``skip``) all at one
  instant, e.g. a batch job submitted at t=0 with a ``deadline_s``.

Tiers are not written into requests unless a class sets ``tier``: the
classifier decides from what is known at arrival (input length, output
budget, task type, tenant SLO class), exactly as for live traffic.

Relative trace paths resolve against the current directory first, then the
repository root (the nearest ancestor of the YAML file holding
``pyproject.toml``), then the YAML file's directory. The format is documented
in docs/slomax.md; ``examples/scenarios/mixed.yaml`` is the reference mix.

This is the experiment harness, not a policy: ``offered_load`` may read
true output lengths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenfleet.core.types import TIERS
from tokenfleet.errors import ConfigError, ValidationError
from tokenfleet.workloads.trace import TraceRequest

_CLASS_KEYS = {
    "name",
    "tier",
    "trace",
    "format",
    "synthetic",
    "options",
    "n_requests",
    "tenant",
    "task_type",
    "slo_class",
    "max_tokens",
    "rate_rps",
    "rate_scale",
    "start_s",
    "at_s",
    "count",
    "skip",
    "client_timeout_s",
    "deadline_s",
    "max_input_tokens",
}
_TOP_KEYS = {"name", "description", "seed", "duration_s", "load", "router", "slo", "classes"}


@dataclass(frozen=True)
class ClassSpec:
    name: str
    trace: Path | None = None
    format: str | None = None
    synthetic: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    n_requests: int | None = None
    tier: str | None = None
    tenant: str | None = None
    task_type: str | None = None
    slo_class: str | None = None
    max_tokens: int | None = None
    rate_rps: float | None = None
    rate_scale: float | None = None
    start_s: float = 0.0
    at_s: float | None = None
    count: int | None = None
    skip: int = 0
    client_timeout_s: float | None = None
    deadline_s: float | None = None
    max_input_tokens: int | None = None  # drop longer prompts (e.g. the model context)

    @property
    def is_job(self) -> bool:
        return self.at_s is not None


@dataclass(frozen=True)
class MixSpec:
    name: str
    duration_s: float
    classes: tuple[ClassSpec, ...]
    seed: int = 0
    router: str | None = None
    slo: Mapping[str, Any] | None = None
    description: str = ""
    source: str = "<mix>"
    #: Offered load (``offered_load``) the streams are scaled to when the
    #: command gives no ``--load``: the mix then keeps its meaning when the
    #: engine model is recalibrated. None: the classes' rates as written.
    load: float | None = None


# -- parsing ---------------------------------------------------------------------
def _num(src: str, fld: str, v: Any, *, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValidationError(src, fld, f"must be a number, got {v!r}")
    f = float(v)
    if f < minimum or (strict and f <= minimum) or f != f or f == float("inf"):
        op = ">" if strict else ">="
        raise ValidationError(src, fld, f"must be a finite number {op} {minimum:g}, got {v!r}")
    return f


def _int(src: str, fld: str, v: Any, *, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValidationError(src, fld, f"must be an integer >= {minimum}, got {v!r}")
    return v


def _str(src: str, fld: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValidationError(src, fld, f"must be a non-empty string, got {v!r}")
    return v


def resolve_path(text: str, yaml_path: Path | None) -> Path:
    """CWD, then the repository root, then the YAML file's directory."""
    p = Path(text)
    if p.is_absolute():
        return p
    candidates = [Path.cwd() / p]
    if yaml_path is not None:
        here = yaml_path.resolve().parent
        for d in (here, *here.parents):
            if (d / "pyproject.toml").exists():
                candidates.append(d / p)
                break
        candidates.append(here / p)
    for c in candidates:
        if c.exists():
            return c
    return candidates[1] if len(candidates) > 1 else candidates[0]


def parse_mix(
    data: Mapping[str, Any], source: str = "<mix>", yaml_path: Path | None = None
) -> MixSpec:
    if not isinstance(data, Mapping):
        raise ValidationError(source, "(top)", "must be a mapping with 'classes'")
    bad = set(data) - _TOP_KEYS
    if bad:
        raise ValidationError(
            source, sorted(bad)[0], f"unknown key; use one of {sorted(_TOP_KEYS)}"
        )
    raw = data.get("classes")
    if not isinstance(raw, list) or not raw:
        raise ValidationError(source, "classes", "must be a non-empty list of request classes")
    duration = _num(source, "duration_s", data.get("duration_s", 600.0), strict=True)
    seed = _int(source, "seed", data.get("seed", 0))
    load = None if data.get("load") is None else _num(source, "load", data["load"], strict=True)
    router = data.get("router")
    if router is not None:
        router = _str(source, "router", router)
    slo = data.get("slo")
    if slo is not None and not isinstance(slo, Mapping):
        raise ValidationError(source, "slo", "must be a mapping (same schema as an --slo file)")
    classes = []
    names: set[str] = set()
    for i, c in enumerate(raw):
        f = f"classes[{i}]"
        if not isinstance(c, Mapping):
            raise ValidationError(source, f, "must be a mapping")
        bad = set(c) - _CLASS_KEYS
        if bad:
            raise ValidationError(
                source, f"{f}.{sorted(bad)[0]}", f"unknown key; use one of {sorted(_CLASS_KEYS)}"
            )
        name = _str(source, f"{f}.name", c.get("name", f"class{i}"))
        if name in names:
            raise ValidationError(source, f"{f}.name", f"duplicate class name {name!r}")
        names.add(name)
        has_trace, has_syn = "trace" in c, "synthetic" in c
        if has_trace == has_syn:
            raise ValidationError(source, f, "give exactly one of 'trace' or 'synthetic'")
        trace = (
            resolve_path(_str(source, f"{f}.trace", c["trace"]), yaml_path) if has_trace else None
        )
        tier = c.get("tier")
        if tier is not None and tier not in TIERS:
            raise ValidationError(source, f"{f}.tier", f"must be one of {list(TIERS)}")
        opts = c.get("options", {})
        if not isinstance(opts, Mapping):
            raise ValidationError(source, f"{f}.options", "must be a mapping")
        if "rate_rps" in c and "rate_scale" in c:
            raise ValidationError(source, f, "give 'rate_rps' or 'rate_scale', not both")
        at_s = None if c.get("at_s") is None else _num(source, f"{f}.at_s", c["at_s"])
        if at_s is not None and ("rate_rps" in c or "rate_scale" in c):
            raise ValidationError(source, f, "a job ('at_s') has no rate; drop rate_rps/rate_scale")
        if has_syn and "n_requests" not in c:
            raise ValidationError(source, f"{f}.n_requests", "required with 'synthetic'")
        spec = ClassSpec(
            name=name,
            trace=trace,
            format=None if c.get("format") is None else _str(source, f"{f}.format", c["format"]),
            synthetic=None if not has_syn else _str(source, f"{f}.synthetic", c["synthetic"]),
            options=dict(opts),
            n_requests=None
            if c.get("n_requests") is None
            else _int(source, f"{f}.n_requests", c["n_requests"], minimum=1),
            tier=tier,
            tenant=None if c.get("tenant") is None else _str(source, f"{f}.tenant", c["tenant"]),
            task_type=None
            if c.get("task_type") is None
            else _str(source, f"{f}.task_type", c["task_type"]),
            slo_class=None
            if c.get("slo_class") is None
            else _str(source, f"{f}.slo_class", c["slo_class"]),
            max_tokens=None
            if c.get("max_tokens") is None
            else _int(source, f"{f}.max_tokens", c["max_tokens"], minimum=1),
            rate_rps=None
            if c.get("rate_rps") is None
            else _num(source, f"{f}.rate_rps", c["rate_rps"], strict=True),
            rate_scale=None
            if c.get("rate_scale") is None
            else _num(source, f"{f}.rate_scale", c["rate_scale"], strict=True),
            start_s=_num(source, f"{f}.start_s", c.get("start_s", 0.0)),
            at_s=at_s,
            count=None
            if c.get("count") is None
            else _int(source, f"{f}.count", c["count"], minimum=1),
            skip=_int(source, f"{f}.skip", c.get("skip", 0)),
            client_timeout_s=None
            if c.get("client_timeout_s") is None
            else _num(source, f"{f}.client_timeout_s", c["client_timeout_s"], strict=True),
            deadline_s=None
            if c.get("deadline_s") is None
            else _num(source, f"{f}.deadline_s", c["deadline_s"], strict=True),
            max_input_tokens=None
            if c.get("max_input_tokens") is None
            else _int(source, f"{f}.max_input_tokens", c["max_input_tokens"], minimum=1),
        )
        classes.append(spec)
    return MixSpec(
        name=str(data.get("name", Path(source).stem)),
        duration_s=duration,
        classes=tuple(classes),
        seed=seed,
        router=router,
        slo=slo,
        description=str(data.get("description", "")),
        source=source,
        load=load,
    )


def load_mix(path: str | Path) -> MixSpec:
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"workload file {p} not found; check the path") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse_mix(data or {}, source=str(p), yaml_path=p)


def missing_traces(spec: MixSpec) -> list[Path]:
    return [c.trace for c in spec.classes if c.trace is not None and not c.trace.exists()]


# -- building requests -------------------------------------------------------------
def _source(spec: ClassSpec, seed: int) -> list[TraceRequest]:
    from tokenfleet.workloads.loader import load_workload
    from tokenfleet.workloads.synthetic import generate

    if spec.trace is not None:
        if not spec.trace.exists():
            raise ConfigError(
                f"class {spec.name!r}: trace file {spec.trace} not found; the "
                "public traces live in ../shared/traces (see its README)"
            )
        kw: dict[str, Any] = {}
        if spec.max_tokens is not None:
            kw["max_tokens"] = spec.max_tokens
        if spec.tenant is not None:
            kw["tenant"] = spec.tenant
        return list(load_workload(spec.trace, spec.format, **kw))
    opts = dict(spec.options)
    if spec.max_tokens is not None:
        opts["max_tokens"] = spec.max_tokens
    if spec.tenant is not None:
        opts.setdefault("tenant", spec.tenant)
    n = spec.n_requests or 0
    rate = float(opts.pop("rate_rps", 10.0))
    return list(generate(str(spec.synthetic), n, seed, rate, **opts))


def _retag(spec: ClassSpec, r: TraceRequest, arrival_s: float) -> TraceRequest:
    info = r.info
    changes: dict[str, Any] = {
        "request_id": f"{spec.name}/{info.request_id}",
        "arrival_s": arrival_s,
    }
    if spec.tenant is not None:
        changes["tenant"] = spec.tenant
    if spec.task_type is not None:
        changes["task_type"] = spec.task_type
    if spec.slo_class is not None:
        changes["slo_class"] = spec.slo_class
    if spec.tier is not None:
        changes["tier"] = spec.tier
    if spec.deadline_s is not None:
        changes["deadline_s"] = arrival_s + spec.deadline_s
    elif info.deadline_s is not None:
        changes["deadline_s"] = arrival_s + (info.deadline_s - info.arrival_s)
    timeout = spec.client_timeout_s if spec.client_timeout_s is not None else r.client_timeout_s
    return replace(r, info=replace(info, **changes), client_timeout_s=timeout)


def build_class(
    spec: ClassSpec, duration_s: float, seed: int = 0, rate_multiplier: float = 1.0
) -> list[TraceRequest]:
    reqs = sorted(_source(spec, seed), key=lambda r: r.info.arrival_s)
    if spec.max_input_tokens is not None:
        reqs = [r for r in reqs if r.info.input_tokens <= spec.max_input_tokens]
    if spec.is_job:
        picked = reqs[spec.skip : spec.skip + spec.count if spec.count else None]
        return [_retag(spec, r, float(spec.at_s or 0.0)) for r in picked]
    reqs = [r for r in reqs[spec.skip :] if r.info.arrival_s >= spec.start_s]
    if len(reqs) < 2:
        return [_retag(spec, r, 0.0) for r in reqs]
    t0 = reqs[0].info.arrival_s
    span = reqs[-1].info.arrival_s - t0
    native = (len(reqs) - 1) / span if span > 0 else float("inf")
    if spec.rate_rps is not None:
        x = spec.rate_rps / native
    else:
        x = spec.rate_scale or 1.0
    x *= rate_multiplier
    out = []
    for r in reqs:
        a = (r.info.arrival_s - t0) / x
        if a > duration_s:
            break
        out.append(_retag(spec, r, a))
        if spec.count is not None and len(out) >= spec.count:
            break
    return out


def build_mix(
    spec: MixSpec, rate_multiplier: float = 1.0, only: str | None = None
) -> list[TraceRequest]:
    """Every class's requests, merged by arrival. Streams scale by
    ``rate_multiplier``; ``only`` = "jobs" | "streams" keeps one kind."""
    if not rate_multiplier > 0:
        raise ConfigError(f"rate multiplier must be > 0, got {rate_multiplier}")
    out: list[TraceRequest] = []
    for i, c in enumerate(spec.classes):
        if (only == "jobs" and not c.is_job) or (only == "streams" and c.is_job):
            continue
        out.extend(build_class(c, spec.duration_s, spec.seed * 1000 + i, rate_multiplier))
    out.sort(key=lambda r: (r.info.arrival_s, r.info.request_id))
    return out


def offered_load(
    reqs: Sequence[TraceRequest], profile: Any, instances: int, duration_s: float
) -> float:
    """Offered work / cluster capacity over the window.

    Work per request is ``scaling.busy_time_s`` (prefill without prefix reuse
    plus decode at a reference batch of 32), so prefix-heavy classes count
    conservatively high.
    """
    from tokenfleet.workloads.scaling import busy_time_s

    if not reqs:
        return 0.0
    return sum(busy_time_s(reqs, profile)) / (instances * duration_s)


def build_at_load(
    spec: MixSpec, load: float, profile: Any, instances: int
) -> tuple[list[TraceRequest], float]:
    """Scale the streams (jobs stay as they are) so the offered load is ``load``.

    Returns the requests and the rate multiplier used. Load is close to
    linear in the multiplier, but not exactly (the window cut, rounding of
    arrival counts), so the first guess is corrected until the offered load
    is within 0.5% (at most four corrections).
    """
    job_load = offered_load(build_mix(spec, only="jobs"), profile, instances, spec.duration_s)
    base = offered_load(build_mix(spec, only="streams"), profile, instances, spec.duration_s)
    if base <= 0 or load <= job_load:
        raise ConfigError(
            f"load {load} is below what the jobs alone offer ({job_load:.2f}); "
            "raise --load or shrink the jobs"
        )
    x = (load - job_load) / base
    reqs = build_mix(spec, x)
    got = offered_load(reqs, profile, instances, spec.duration_s)
    for _ in range(4):
        if abs(got - load) <= 0.005 * load or got <= job_load:
            break
        x *= (load - job_load) / (got - job_load)
        reqs = build_mix(spec, x)
        got = offered_load(reqs, profile, instances, spec.duration_s)
    if abs(got - load) > 0.05 * load:
        raise ConfigError(
            f"could not scale the streams to load {load}: they offer {got:.2f} "
            "at best (a source trace runs out within the window at that rate); "
            "lower --load or use longer traces"
        )
    return reqs, x
