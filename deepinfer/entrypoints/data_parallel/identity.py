"""Who is who behind a data-parallel front end: the secrets replicas join with, and the client a
request counts for.

Replicas. A replica registers (`POST /dp/register`) and is sent every request with a secret in the
`x-deepinfer-dp-secret` header:

    a local child    the per-run secret its front end put into its environment (DEEPINFER_DP_SECRET,
                     never on a command line); only that child registers its rank
    any other rank   the cluster secret, --data-parallel-secret S or --data-parallel-secret-file F,
                     the same on the front end and on every replica that joins it; a front end
                     without one accepts no replica but its own children

Secrets are compared in constant time. An API key is never a secret: clients hold those.

Clients. The front end counts each request for its client (`serving.admission.client_key`): the API
key it presented when that is one of the front end's --api-key keys (`key:` and a short hash of it,
as the replicas name tenants), else its peer address (`addr:IP`). A key the front end does not accept
names nobody: a client cannot make up keys to get new shares. The replica learns the client from
`x-deepinfer-client`, which it believes only beside its own secret (`serving.tenancy.forwarded_client`,
called by the replica's per-client admission): a client that sends the header itself gains nothing.
"""

from __future__ import annotations

import os

from deepinfer.serving.tenancy import CLIENT_HEADER, SECRET_HEADER, same_secret

__all__ = ["CLIENT_HEADER", "HOST_SECRET_ENV", "SECRET_ENV", "SECRET_HEADER", "check_secret", "cluster_secret",
           "same_secret"]

SECRET_ENV = "DEEPINFER_DP_SECRET"  # a local child's secret, from its front end
HOST_SECRET_ENV = "DEEPINFER_HOST_SECRET"  # a model host's child's secret (model_host/launch.py)
MIN_SECRET_CHARS = 16
MAX_SECRET_CHARS = 4096


def check_secret(secret: str, flag: str) -> str:
    """`secret` when it is fit to be one: printable ASCII without whitespace, MIN_SECRET_CHARS or more.
    ValueError naming `flag` (never the secret) otherwise."""
    if not MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS:
        raise ValueError(f"{flag}: a secret of {len(secret)} characters; it must have {MIN_SECRET_CHARS} to "
                         f"{MAX_SECRET_CHARS} (e.g. `python -c \"import secrets; print(secrets.token_hex(32))\"`)")
    if not all("\x21" <= c <= "\x7e" for c in secret):
        raise ValueError(f"{flag}: the secret must be printable ASCII without spaces (it travels in a header)")
    return secret


def cluster_secret(args) -> str | None:
    """The cluster secret of --data-parallel-secret or --data-parallel-secret-file (its first line,
    trailing whitespace dropped); None when neither is given. ValueError naming the flag."""
    given, path = args.data_parallel_secret, args.data_parallel_secret_file
    if given is not None and path is not None:
        raise ValueError("give --data-parallel-secret or --data-parallel-secret-file, not both")
    if given is not None:
        return check_secret(given, "--data-parallel-secret")
    if path is None:
        return None
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            text = f.read(MAX_SECRET_CHARS + 2)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--data-parallel-secret-file {path!r} cannot be read: {exc}") from None
    return check_secret(text.rstrip("\r\n\t "), f"--data-parallel-secret-file {path!r}")
