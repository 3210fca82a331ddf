"""A pool whose router may split requests into a prefill and a decode phase.

Two-phase requests run as vLLM's disaggregated serving runs them behind a
P/D router (vllm-router ``--vllm-pd-disaggregation``, llm-d's sidecar):

1. the prefill request (``max_tokens`` 1, ``kv_transfer_params.do_remote_decode``)
   runs on the prefill instance, which keeps the prompt's KV after its token;
2. the decode request, carrying the returned params, goes to the decode
   instance, which takes blocks for the prompt's KV, receives it
   (``KVLink.transfer_s``: NVLink inside a node, RDMA across), frees nothing
   on the prefill side until it has it, then recomputes the last prompt
   token, streams the first token to the client and decodes.

The client's TTFT therefore includes the prefill queue, the prefill, the
transfer and the decode side's first step. KV is held on both ends while the
transfer is in flight. Roles come from the router (``initial_roles``,
``plan_roles`` every control period) and only restrict routing: work already
on an instance finishes there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenfleet.core.routing import ROUTERS
from tokenfleet.core.routing.pd_base import PDRouter, split
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import PoolSnapshot, RequestInfo, RouteDecision
from tokenfleet.engine.instance import EngineRequest, StepResult
from tokenfleet.engine.kv_link import KVLink
from tokenfleet.errors import CapacityError, NoCandidateError
from tokenfleet.sim.cluster import PoolConfig, PoolSim, _Flight
from tokenfleet.sim.core import Environment
from tokenfleet.sim.records import RequestRecord
from tokenfleet.workloads.trace import TraceRequest

PREFILL_SUFFIX = "/prefill"


def is_disaggregating(router: str) -> bool:
    return bool(getattr(ROUTERS.get(router), "disaggregating", False))


@dataclass(slots=True)
class _Phase:
    """The prefill half of a disaggregated request."""

    flight: _Flight
    prefill_idx: int
    decode_idx: int
    prefill_req: EngineRequest
    prefill_cached_tokens: int = 0  # the router's cache estimate on the prefill side
    prefill_done_s: float | None = None
    transfer_s: float = 0.0
    transfer_done_s: float | None = None


@dataclass
class PDStats:
    """What the P/D pool did, for reports and tests."""

    disaggregated: int = 0
    aggregated: int = 0
    transfer_s: list[float] = field(default_factory=list)
    #: client request id -> (prefill instance, decode instance, transfer seconds)
    placements: dict[str, tuple[str, str, float]] = field(default_factory=dict)
    roles: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)


class PDPoolSim(PoolSim):
    """A PoolSim that runs disaggregated requests in two phases."""

    def __init__(
        self,
        env: Environment,
        config: PoolConfig,
        slo: SLOConfig,
        on_done: Callable[[RequestRecord], None] | None = None,
        link: KVLink | None = None,
        role_period_s: float = 5.0,
    ) -> None:
        super().__init__(env, config, slo, on_done)
        self.link = link or KVLink()
        self._phases: dict[str, _Phase] = {}  # client request id -> prefill half
        self._by_prefill_id: dict[str, _Phase] = {}
        self.pd = PDStats()
        for views in self.views:
            for i, v in enumerate(views):
                v.node = self.link.node_of(i, config.profile)
        router = self.routers[0]
        if isinstance(router, PDRouter):
            self._set_roles(router.initial_roles(len(self.engines)))
        self.role_period_s = role_period_s
        self._planning = False

    # -- roles ---------------------------------------------------------------------
    def _set_roles(self, roles: list[str]) -> None:
        for views in self.views:
            for v, r in zip(views, roles, strict=True):
                v.role = r
        self.pd.roles.append((self.env.now, tuple(roles)))

    def _plan(self) -> None:
        router = self.routers[0]
        if isinstance(router, PDRouter):
            snap = PoolSnapshot(self.env.now, self.views[0], 0)
            roles = router.plan_roles(snap)
            if roles is not None:
                self._set_roles(roles)
        if self.inflight > 0:
            self.env.schedule(self.role_period_s, self._plan)
        else:
            self._planning = False

    # -- routing -------------------------------------------------------------------
    def _route_and_dispatch(
        self,
        trace: TraceRequest,
        info: RequestInfo,
        record: RequestRecord,
        replica: int,
        snap: PoolSnapshot,
    ) -> None:
        router = self.routers[replica]
        if not isinstance(router, PDRouter):
            super()._route_and_dispatch(trace, info, record, replica, snap)
            return
        # Once the pool is split, an admission layer's instance subset (SLOMax's
        # per-tier capacity split) is not applied: the P/D router's pools
        # replace it; admission still decides when a request is dispatched.
        if split(self.views[replica]):
            snap = PoolSnapshot(snap.now_s, self.views[replica], replica)
        if not self._planning:
            self._planning = True
            self.env.schedule(self.role_period_s, self._plan)
        try:
            d = router.route_pd(info, snap)
        except NoCandidateError:
            self._finish_unrouted(record, "rejected")
            return
        if not d.disaggregated:
            self.pd.aggregated += 1
            self._dispatch(
                trace,
                info,
                record,
                replica,
                RouteDecision(
                    d.prefill_instance_id, d.expected_cached_tokens, d.predicted_ttft_s, d.reason
                ),
            )
            return
        p_idx = self.by_index[d.prefill_instance_id]
        d_idx = self.by_index[str(d.decode_instance_id)]
        out = min(trace.output_tokens, info.max_tokens)
        decode_req = EngineRequest(
            info.request_id,
            info.input_tokens,
            out,
            info.block_hashes,
            trace.output_block_hashes,
            remote_kv_tokens=info.input_tokens,
        )
        prefill_req = EngineRequest(
            info.request_id + PREFILL_SUFFIX, info.input_tokens, 1, info.block_hashes, hold_kv=True
        )
        try:
            self.engines[p_idx].check(prefill_req)
            self.engines[d_idx].check(decode_req)
        except CapacityError:
            self._finish_unrouted(record, "rejected")
            return
        self.pd.disaggregated += 1
        now = self.env.now
        record.dispatched_s = now
        record.instance_id = self.engines[d_idx].instance_id
        record.dc = self.cfg.dc
        record.predicted_ttft_s = d.predicted_ttft_s
        self.views[replica][p_idx].accounting.on_dispatch(info, d.expected_cached_tokens)
        fl = _Flight(
            trace,
            info,
            record,
            replica,
            d_idx,
            info.input_tokens,  # the decode side expects the whole prompt's KV
            d.predicted_ttft_s,
            decode_req,
            hook_instance=p_idx,
        )
        phase = _Phase(fl, p_idx, d_idx, prefill_req, d.expected_cached_tokens)
        self._flights[info.request_id] = fl
        self._phases[info.request_id] = phase
        self._by_prefill_id[prefill_req.request_id] = phase
        self.inflight += 1
        if self.on_dispatch is not None:
            self.on_dispatch(info, p_idx, d.expected_cached_tokens)
        self.engines[p_idx].add(prefill_req)
        if not self.engines[p_idx].stepping:
            self._start_step(p_idx)

    # -- steps -----------------------------------------------------------------------
    def _apply_step(self, idx: int, res: StepResult) -> None:
        now = self.env.now
        for er in res.remote_loaded:  # the decode side has the KV: the prefill side frees it
            ph = self._phases.get(er.request_id)
            if ph is None:
                continue
            ph.transfer_done_s = now
            self.engines[ph.prefill_idx].release(ph.prefill_req.request_id, transferred=True)
        if self._by_prefill_id:
            for er in res.finished:
                ph = self._by_prefill_id.pop(er.request_id, None)
                if ph is not None:
                    self._prefill_done(ph, now)
            res = StepResult(
                [r for r in res.first_tokens if not r.request_id.endswith(PREFILL_SUFFIX)],
                [r for r in res.finished if not r.request_id.endswith(PREFILL_SUFFIX)],
                res.tokens_emitted,
                res.remote_loaded,
            )
        super()._apply_step(idx, res)

    def _prefill_done(self, ph: _Phase, now: float) -> None:
        """The prefill response came back: send the decode request."""
        fl = ph.flight
        if fl.done:
            self.engines[ph.prefill_idx].release(ph.prefill_req.request_id)
            return
        ph.prefill_done_s = now
        views = self.views[fl.replica]
        p_view = views[ph.prefill_idx]
        p_view.accounting.on_first_token(fl.info, ph.prefill_cached_tokens)
        p_view.accounting.on_finish(fl.info, True, ph.prefill_cached_tokens)
        router = self.routers[fl.replica]
        if isinstance(router, PDRouter):
            router.on_prefill_done(fl.info, p_view.instance_id, now)
        same = views[ph.prefill_idx].node == views[ph.decode_idx].node
        ph.transfer_s = self.link.transfer_s(self.cfg.profile, fl.info.input_tokens, same)
        fl.engine_req.remote_load_s = ph.transfer_s
        fl.record.cached_tokens = ph.prefill_req.cached_tokens
        self.pd.transfer_s.append(ph.transfer_s)
        self.pd.placements[fl.info.request_id] = (
            p_view.instance_id,
            views[ph.decode_idx].instance_id,
            ph.transfer_s,
        )
        views[ph.decode_idx].accounting.on_dispatch(fl.info, fl.expected_cached_tokens)
        engine = self.engines[ph.decode_idx]
        engine.add(fl.engine_req)
        if not engine.stepping:
            self._start_step(ph.decode_idx)

    def _complete(self, fl: _Flight, status: str) -> None:
        ph = self._phases.pop(fl.info.request_id, None)
        if ph is not None and ph.prefill_done_s is None:
            # ended before its decode half was sent: the router's accounting of
            # the prefill instance closes here, the decode instance never saw it
            self._by_prefill_id.pop(ph.prefill_req.request_id, None)
            self.engines[ph.prefill_idx].abort(ph.prefill_req.request_id)
            p_acc = self.views[fl.replica][ph.prefill_idx].accounting
            p_acc.on_finish(fl.info, False, ph.prefill_cached_tokens)
            fl.done = True
            self._flights.pop(fl.info.request_id, None)
            self.inflight -= 1
            rec = fl.record
            rec.finish_s = self.env.now
            rec.status = status
            if self.on_done is not None:
                self.on_done(rec)
            return
        if ph is not None and ph.transfer_done_s is None:
            self.engines[ph.prefill_idx].release(ph.prefill_req.request_id)
        super()._complete(fl, status)

    def cancel(self, request_id: str, status: str = "cancelled") -> bool:
        ph = self._phases.get(request_id)
        if ph is None or ph.prefill_done_s is not None:
            return super().cancel(request_id, status)
        fl = ph.flight
        if fl.done:
            return False
        self._complete(fl, status)
        return True


def make_pool(
    env: Environment,
    config: PoolConfig,
    slo: SLOConfig,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> PoolSim:
    """A P/D pool for a disaggregating router, the plain pool otherwise."""
    if is_disaggregating(config.router):
        return PDPoolSim(env, config, slo, on_done)
    return PoolSim(env, config, slo, on_done)
