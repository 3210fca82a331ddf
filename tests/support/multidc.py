"""Several datacenters on one machine, laid out as docs/deployment.md deploys them.

The API and the global stores (Redis hot state, PostgreSQL) sit in the entry
datacenter's region. Every datacenter with engines gets its own broker (an
embedded Redis) next to its workers. Connections that cross regions go
through a :class:`~tests.support.wan.WanLink` delaying each chunk by half the
topology's RTT: the API to a remote DC's broker, a remote DC's workers to the
global Redis. Used by ``tests/test_live_multidc.py`` and
``benchmarks/multidc_live.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfleet.service.embedded import EmbeddedRedis

from .stack import InstanceSpec, LiveStack
from .wan import WanLink


@dataclass
class MultiDC:
    stack: LiveStack
    brokers: dict[str, EmbeddedRedis]
    #: the API's link to each remote DC's broker, by DC
    api_links: dict[str, WanLink] = field(default_factory=dict)
    #: each remote DC's workers' link to the global Redis, by DC
    state_links: dict[str, WanLink] = field(default_factory=dict)
    #: workers' links to other DCs' brokers (re-sends)
    other_links: list[WanLink] = field(default_factory=list)
    #: the API's links to each remote DC's engines (it streams them itself)
    engine_links: dict[str, list[WanLink]] = field(default_factory=dict)

    def links_of(self, dc: str) -> list[WanLink]:
        """Every link between ``dc`` and the entry DC (what cutting it off cuts)."""
        own = [x for x in (self.api_links.get(dc), self.state_links.get(dc)) if x is not None]
        return own + self.engine_links.get(dc, [])

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.stack.stop()
        engines = [x for links in self.engine_links.values() for x in links]
        for link in [
            *self.api_links.values(),
            *self.state_links.values(),
            *self.other_links,
            *engines,
        ]:
            link.stop()
        for b in self.brokers.values():
            with contextlib.suppress(Exception):
                b.stop()


@contextlib.contextmanager
def multidc_stack(
    data_dir: Path,
    instances: list[InstanceSpec],
    *,
    entry_dc: str,
    rtt_ms: Callable[[str, str], float],
    live_overrides: dict[str, Any] | None = None,
    **stack_kwargs: Any,
) -> Iterator[MultiDC]:
    """A started :class:`MultiDC`; ``rtt_ms(a, b)`` is the round trip between
    two datacenters (0: same place, no link)."""
    dcs = sorted({s.dc for s in instances})
    brokers = {dc: EmbeddedRedis(data_dir / f"broker-{dc}").start() for dc in dcs}
    out = MultiDC(stack=None, brokers=brokers)  # type: ignore[arg-type]
    try:
        api_view: dict[str, str] = {}
        for dc in dcs:
            one_way = rtt_ms(entry_dc, dc) / 2
            if one_way > 0:
                out.api_links[dc], api_view[dc] = WanLink.to_url(brokers[dc].url, one_way)
            else:
                api_view[dc] = brokers[dc].url
        overrides = dict(live_overrides or {})
        overrides.update(
            entry_dc=entry_dc,
            dc_broker_urls=",".join(f"{dc}={url}" for dc, url in api_view.items()),
        )
        stack = LiveStack(
            data_dir=data_dir, instances=instances, live_overrides=overrides, **stack_kwargs
        )
        out.stack = stack

        def before_workers() -> None:
            assert stack.redis is not None
            for dc in dcs:
                one_way = rtt_ms(entry_dc, dc) / 2
                env: dict[str, str] = {}
                if one_way > 0:
                    out.state_links[dc], env["TOKENFLEET_REDIS_URL"] = WanLink.to_url(
                        stack.redis.url, one_way
                    )
                # a DC's workers: their own broker is local; another DC's (for a
                # re-send there) is across the WAN
                theirs: dict[str, str] = {}
                for other in dcs:
                    theirs[other] = brokers[other].url
                    if other != dc and rtt_ms(dc, other) > 0:
                        link, theirs[other] = WanLink.to_url(
                            brokers[other].url, rtt_ms(dc, other) / 2
                        )
                        out.other_links.append(link)
                env["TOKENFLEET_DC_BROKER_URLS"] = ",".join(f"{k}={v}" for k, v in theirs.items())
                stack.worker_env[dc] = env
            # the API streams each engine itself: a remote DC's engines across the WAN
            for spec in stack.instances:
                one_way = rtt_ms(entry_dc, spec.dc) / 2
                if one_way > 0:
                    link, url = WanLink.to_url(stack.engine_urls[spec.instance_id], one_way)
                    out.engine_links.setdefault(spec.dc, []).append(link)
                    spec.worker_args = [*spec.worker_args, "--public-engine-url", url]

        stack.before_workers = before_workers
        stack.start()
        yield out
    finally:
        out.stop()
