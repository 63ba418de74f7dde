"""A request's priority class (issue 33): its tenant's highest allowed class, or a less urgent one
the request asks for (policies/priority_classes.py: interactive -1, default 0, batch 1, any
integer; lower is more urgent).

A request asks through

    X-Priority-Class: batch      a class name or an integer (this header is the router's own:
                                 it is not sent to the workers); anything else is a 400 naming
                                 the header
    "priority": 1                the body's integer, as vLLM has it

and gets the least urgent of its tenant's class and what it asks. A request that asks for a
*more* urgent class than its tenant allows is served in its tenant's class, silently, as if it
had asked nothing (no 400): as OpenAI's `service_tier` falls back to what the account may use.
A client sending one fixed priority under several keys, or a key moved to a less urgent tenant,
keeps working, and a hostile client gains nothing that asking nothing would not give it. The
answer's `X-Priority-Class` header says the class it was served in (streamed or whole), so a
client can see that its ask was not granted. The anonymous `default` tenant of open mode
bounds nothing: what the request asks is its class (else 0), as before tenants existed.

**What the engine sees.** The body is sent to the workers as the client wrote it, `priority`
included, as before classes had names: a vLLM worker started without `--scheduling-policy
priority` refuses a non-zero `priority`, and the router does not know how its workers were
started, so it adds none (a class asked by the header, or a tenant's class, never reaches the
engine's body). One exception: a body `priority` more urgent than its tenant allows is removed
from the body, so a worker that does order by priority never ranks the request above what its
tenant may have (and the request is, there too, as if it had asked nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.priority_classes import parse_class
from router.errors import InvalidRequest
from router.tenants import TenantSpec

__all__ = ["PRIORITY_HEADER", "request_class"]

PRIORITY_HEADER = "X-Priority-Class"


def request_class(tenant: TenantSpec, body: dict[str, Any], headers: Mapping[str, str]) -> int:
    """The class of a request of `tenant` with `body` and `headers` (the module's docstring);
    a body `priority` more urgent than the tenant allows is removed from `body`. Raises
    InvalidRequest (400) for an X-Priority-Class that is not a class."""
    asked: list[int] = []
    raw = headers.get(PRIORITY_HEADER)
    if raw is not None:
        try:
            asked.append(parse_class(raw))
        except ValueError as exc:
            raise InvalidRequest(f"{PRIORITY_HEADER}: {exc}", param=PRIORITY_HEADER) from exc
    in_body = body.get("priority")
    if isinstance(in_body, int) and not isinstance(in_body, bool):  # else: counts as unset
        if tenant.implicit or in_body >= tenant.priority:
            asked.append(in_body)
        else:
            del body["priority"]  # more urgent than allowed: as if not asked, for the engine too
    if tenant.implicit:
        return max(asked) if asked else tenant.priority
    return max([tenant.priority, *asked])
