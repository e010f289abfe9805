"""Who sends a request: its tenant (the API key it presented) and the client its work counts for.

    --api-key KEY        a client key (repeat the flag or separate keys with commas): each key is a
                         tenant of its own
    --admin-api-key KEY  an operator key: accepted wherever a client key is, and sees every tenant
    no key at all        one tenant for everyone: nothing is checked, so nothing can be kept apart

A tenant's data is its own: stored responses (and `previous_response_id`), the dashboard's request
list and per-request views. Another tenant's data answers exactly as missing data does, so a
tenant cannot even learn that it exists. A tenant's id is a short hash of its key, never the key.

How a key is sent: `Authorization: Bearer KEY` on every route, and `x-api-key: KEY` as well on
Anthropic's /v1/messages routes (what the `anthropic` client sends). Exactly one of each header
may be sent (two are a 400); a missing key and a wrong one are 401s (compared in constant time
with every accepted key).

The client (for the scheduler's fair share and the per-client limits): the tenant when keys are
set; else the body's `user` for the fair share (hashed) and the peer address for the limits. Behind
a data-parallel front end every request comes from the front end's address, so the front end names
the client in `x-deepinfer-client`, and a replica believes it only beside its own cluster secret in
`x-deepinfer-dp-secret` (`forwarded_client`): a client that sends the header itself gains nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deepinfer.serving.errors import ServingError, bad_request

GetHeaders = Callable[[str], list[str]]  # a header name (lower case) -> every value the request sent
SECRET_HEADER = "x-deepinfer-dp-secret"  # a data-parallel front end's (or child replica's) secret
CLIENT_HEADER = "x-deepinfer-client"  # the client a front end forwards a request for
_CLIENT_ID = re.compile(r"(?:key|addr):[\x21-\x7e]{1,64}")  # what a front end sends, and nothing longer


@dataclass(frozen=True)
class Tenant:
    """The owner of a request's data; `admin`: an operator key, which sees every tenant's."""

    id: str
    admin: bool = False

    def owns(self, owner: str | None) -> bool:
        """Whether data of tenant (or client) `owner` is this tenant's to see: an operator's sees all,
        and so does everyone on a server without keys (nothing is kept apart there)."""
        return self.admin or self.id == EVERYONE_ID or owner == self.id


EVERYONE_ID = "everyone"
EVERYONE = Tenant(EVERYONE_ID)  # the one tenant of a server without keys


def api_keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """The accepted keys of `--api-key`: one string, or several (each may be comma-separated);
    blanks dropped. Empty: no key is checked."""
    given = [api_key] if isinstance(api_key, str) else list(api_key or ())
    return tuple(dict.fromkeys(k.strip() for item in given for k in item.split(",") if k.strip()))


def key_id(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


class Credentials:
    """The keys a server accepts, and the tenant each request is."""

    def __init__(self, api_key: str | Sequence[str] | None = None, admin_api_key: str | Sequence[str] | None = None):
        self.client_keys = tuple(k.encode() for k in api_keys(api_key))
        self.admin_keys = tuple(k.encode() for k in api_keys(admin_api_key))

    @property
    def checked(self) -> bool:
        """Whether requests must present a key."""
        return bool(self.client_keys or self.admin_keys)

    def tenant(self, headers: GetHeaders, x_api_key: bool = False) -> Tenant:
        """The tenant of a request (its key checked); a 401 without a valid key, a 400 for a key
        header sent twice. `x_api_key`: the route also takes `x-api-key` (Anthropic's)."""
        if not self.checked:
            return EVERYONE
        given = presented_key(headers, ("x-api-key", "authorization") if x_api_key else ("authorization",))
        where = "x-api-key" if x_api_key else None  # Anthropic's messages name the header
        if given is None:
            ways = "`x-api-key: KEY` or `Authorization: Bearer KEY`" if x_api_key else "`Authorization: Bearer KEY`"
            raise ServingError(401, f"You didn't provide an API key; send it as {ways}", path=where,
                               code="invalid_api_key")
        candidate = given.encode()
        admin = _matches(candidate, self.admin_keys)
        if not (admin or _matches(candidate, self.client_keys)):
            raise ServingError(401, "invalid API key" if x_api_key else "Incorrect API key provided", path=where,
                               code="invalid_api_key")
        return Tenant(key_id(given), admin=admin)


def _matches(candidate: bytes, keys: tuple[bytes, ...]) -> bool:
    return sum(hmac.compare_digest(candidate, key) for key in keys) > 0  # no early exit


def presented_key(headers: GetHeaders, names: tuple[str, ...] = ("x-api-key", "authorization")) -> str | None:
    """The key of the first of `names` the request sends (a Bearer token for `authorization`: any
    other scheme gives ""); None when it sends none; a 400 for a header given twice."""
    for name in names:
        values = headers(name)
        if len(values) > 1:
            shown = "Authorization" if name == "authorization" else name
            raise bad_request(f"the request has {len(values)} {shown} headers; send exactly one",
                              code="invalid_api_key")
        if values and values[0]:
            if name == "x-api-key":
                return values[0].strip()
            scheme, _, token = values[0].partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def same_secret(given: str | None, expected: str | None) -> bool:
    """Whether `given` (a header's value) is `expected`, compared in constant time; never with no secret."""
    if not expected or given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


def forwarded_client(headers: GetHeaders, secret: str | None) -> str | None:
    """The client a data-parallel front end names in `x-deepinfer-client`, when the request carries
    exactly one `x-deepinfer-dp-secret` equal to this replica's `secret` (else None)."""
    given, client = headers(SECRET_HEADER), headers(CLIENT_HEADER)
    if not secret or len(given) != 1 or len(client) != 1 or not same_secret(given[0], secret):
        return None
    return client[0] if _CLIENT_ID.fullmatch(client[0]) else None


def fair_share_client(tenant: Tenant, user: str | None) -> str | None:
    """Whom a request counts for in the scheduler's fair share: its tenant when keys are set; else
    the body's `user` (hashed, to bound its length); else None, the one anonymous client."""
    if tenant is not EVERYONE:
        return tenant.id
    if user:
        return "user:" + hashlib.sha256(user.encode()).hexdigest()[:16]
    return None
