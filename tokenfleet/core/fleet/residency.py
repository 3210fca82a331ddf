"""Hard filters for DC selection: permissions, data residency, serving.

Every selector receives only datacenters that already passed
:func:`compliant`; the wrapper in ``policies.select_dc`` applies it and then
rejects any decision outside the filtered set. That is what makes a
residency violation impossible by construction rather than by care: no
policy code path sees a non-compliant datacenter at all.

The rule (docs/fleetmind.md):

* the tenant may use the site (``allowed_dcs``);
* the site's region is one of the tenant's ``allowed_regions``;
* if either the tenant or the request forbids crossing regions, the site's
  region must equal the request's *data region* (its ``region``, else its
  home site's region); with no data region known nothing qualifies;
* entry sites hold no GPUs and never serve.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from tokenfleet.core.fleet.topology import Tenant
from tokenfleet.core.types import RequestInfo


class _Site(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def region(self) -> str: ...

    @property
    def entry(self) -> bool: ...


def data_region(request: RequestInfo, home_region: str | None) -> str | None:
    """Where the request's data lives: its own region, else its home's."""
    return request.region if request.region else home_region


def may_cross_region(request: RequestInfo, tenant: Tenant) -> bool:
    return tenant.allow_cross_region and request.allow_cross_region


def compliant(request: RequestInfo, tenant: Tenant, site: _Site, home_region: str | None) -> bool:
    """May ``request`` be processed at ``site`` at all (ignoring load)?"""
    if site.entry:
        return False
    if tenant.allowed_dcs is not None and site.name not in tenant.allowed_dcs:
        return False
    if tenant.allowed_regions is not None and site.region not in tenant.allowed_regions:
        return False
    if not may_cross_region(request, tenant):
        region = data_region(request, home_region)
        if region is None or site.region != region:
            return False
    return True


def compliant_sites(
    request: RequestInfo, tenant: Tenant, sites: Iterable[_Site], home_region: str | None
) -> list[str]:
    return [s.name for s in sites if compliant(request, tenant, s, home_region)]
