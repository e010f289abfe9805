"""The API key check of every route behind `--api-key` / `--admin-api-key`: one FastAPI dependency.

It asks `deepinfer.serving.tenancy.Credentials` which tenant the request is (a 401 without a valid
key) and leaves it on `request.state.tenant`, where the routes read it (`tenant_of`).
"""

from __future__ import annotations

from fastapi import Request

from deepinfer.serving.errors import ServingError
from deepinfer.serving.tenancy import EVERYONE, Credentials, Tenant


def api_key_dependency(credentials: Credentials, x_api_key: bool = False, admin_only: bool = False):
    """A dependency: the request must present a key `credentials` accept (`x_api_key`: also as
    `x-api-key`; `admin_only`: an operator key, when operator keys are set)."""

    async def verify(request: Request) -> None:
        tenant = credentials.tenant(request.headers.getlist, x_api_key)
        if admin_only and credentials.admin_keys and not tenant.admin:
            raise ServingError(403, "this route needs an operator key (--admin-api-key)", "permission_error",
                               code="admin_key_required")
        request.state.tenant = tenant

    return verify


def tenant_of(request: Request) -> Tenant:
    """The tenant the key check found (everyone's, on a route without the check)."""
    tenant = request.scope.get("state", {}).get("tenant")  # where request.state keeps it
    return tenant if isinstance(tenant, Tenant) else EVERYONE
