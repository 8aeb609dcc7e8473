"""What each data-parallel replica does (`serve -dp D --replica-roles prefill,decode`): disaggregated prefill and
decode, after DistServe and Splitwise. A long prompt's prefill steps stretch every running stream's next token when
both share an engine; split, a prefill replica computes each new request's prompt and first token, then the
request's KV moves to a decode replica (engine/kv_transfer.py through the HTTP process), which streams the rest.

Roles, one per replica: `prefill` (new requests; each streamed one leaves after its first token), `decode` (takes
the requests the prefill replicas hand over; new requests only while no replica that prefills is up) and `mixed`
(both, the default: what every replica does without the flag). Any mix, as long as some replica can prefill and
some can decode."""

ROLES = ("prefill", "decode", "mixed")
PREFILLS = ("prefill", "mixed")
DECODES = ("decode", "mixed")


def replica_roles(text: str | None, replicas: int) -> list[str]:
    """The role of each replica from --replica-roles (None: every one mixed); ValueError naming the flag."""
    if text is None:
        return ["mixed"] * replicas
    roles = [r.strip() for r in text.split(",")]
    if replicas < 2:
        raise ValueError("--replica-roles needs --data-parallel-size 2 or more: one engine prefills and decodes")
    if len(roles) != replicas:
        raise ValueError(f"--replica-roles lists {len(roles)} for --data-parallel-size {replicas}: one role per "
                         "replica, comma-separated")
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise ValueError(f"--replica-roles: {bad[0]!r} is not a role: prefill, decode or mixed")
    if not any(r in PREFILLS for r in roles):
        raise ValueError("--replica-roles: no replica prefills (give one prefill or mixed)")
    if not any(r in DECODES for r in roles):
        raise ValueError("--replica-roles: no replica decodes (give one decode or mixed)")
    return roles
