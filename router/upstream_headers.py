"""What a worker is sent besides the body, on every request path (the prefill and decode legs:
router/request/legs.py; one worker's whole answer: router/edge/passthrough.py).

    Content-Type        application/json
    X-Request-Id        the request's id (router/edge/front_door.py): the workers take it as
                        their own, so one id follows the request through every log
    forward_headers     the client's headers of those names, as they came (tracing, the
                        simulated workers' replay header)
    Authorization       the worker's own API key when it has one; else the client's, when
                        `forward_client_auth`; else none

A leg adds what only it knows (a resumed stream's token count, its tracing span, a vLLM
data-parallel rank target's `X-data-parallel-rank`: router/adapters/dp_rank.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from router.config import Settings
from router.worker_spec import WorkerSpec

__all__ = ["upstream_headers"]


def upstream_headers(
    settings: Settings, client: Mapping[str, str], request_id: str, worker: WorkerSpec
) -> dict[str, str]:
    """The headers of a request to `worker` on behalf of the client whose headers are `client`."""
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    for name in settings.upstream.forward_headers:
        value = client.get(name)
        if value is not None:
            headers[name] = value
    if worker.api_key:
        headers["Authorization"] = "Bearer " + worker.api_key.reveal()
    elif settings.auth.forward_client_auth and "Authorization" in client:
        headers["Authorization"] = client["Authorization"]
    return headers
