"""Cache salts: which partition of the services' shared caches a request reads and adds to.

The verify and draft services' prefix caches and the suffix lookup's cache of outputs (the draft
service's suffix drafter, the coordinator's own) are shared across requests; each is partitioned by
a *cache salt*, as vLLM's ``cache_salt`` partitions its prefix cache: a request finds only what
requests of the same salt computed (docs/security.md#tenants-and-the-caches). The coordinator
derives a request's salt from who calls and sends it with every Prefill; the services never see
an API key.

- A caller's salt is derived from its owner (:attr:`coordinator.api.auth.Caller.owner`, the owner
  hash of its API key), so each key has a partition of its own and its requests hit only their own
  entries (a chat's second turn, a system prompt the key sent before).
- A request may name a salt of its own (``GenerateRequest.cache_salt``, the HTTP body's
  ``cache_salt``): its partition is then derived from the owner *and* that name, a partition within
  the key's; whatever name it gives, a key never reaches another owner's partition.
- Without API keys every caller's owner is "": a keyless deployment serves one tenant, whose
  requests share the unsalted partition (as they share their stored requests: any caller may
  resume any request).
- ``--shared-caches`` (a trusted single-tenant deployment with several keys) treats every owner as
  "": requests without a salt of their own share the unsalted partition again.
"""

import hashlib

SALT_BYTES = 16  # a derived salt's length: 128 bits, in hex


def cache_salt(owner: str, request_salt: str = "", shared: bool = False) -> str:
    """The cache salt of a request of ``owner`` (the caller's owner hash, "" without API keys)
    naming ``request_salt`` ("" for none); ``shared``: the coordinator's ``--shared-caches``.
    Returns "" (the unsalted partition) for a request without a salt of a keyless or shared
    deployment, else SHA-256 over the owner and the request's salt, each length-prefixed (no two
    pairs give the same input), 128 bits in hex."""
    owner = "" if shared else owner
    if not owner and not request_salt:
        return ""
    digest = hashlib.sha256()
    for part in (owner.encode(), request_salt.encode()):
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.hexdigest()[: 2 * SALT_BYTES]
