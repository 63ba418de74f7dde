"""SGLang's side of the simulated worker: the native `/generate` answer shape and info endpoints.

    POST /generate          {"text", "sampling_params": {"max_new_tokens", ...}, "stream"}
                            -> {"text", "output_ids", "meta_info": {"id", "finish_reason", ...}}
                            streamed: `data: {"text": <cumulative>, "meta_info": ...}` per token,
                            then `data: [DONE]` (SGLang streams the whole text so far by default)
    GET  /server_info, /get_server_info   server args + internal_states + version (dp_size, the
                                          disaggregation mode and bootstrap port: what
                                          sglang-router reads when it registers a worker)
    GET  /model_info, /get_model_info     model_path, tokenizer_path, is_generation, ...
    GET  /get_load                        [{"dp_rank", "num_reqs", "num_waiting_reqs",
                                            "num_tokens"}], one entry per data-parallel rank
    GET  /health_generate                 200 while the engine runs

The generation itself goes through `disagg_tools.sim.generation` like the OpenAI paths; only the
shape differs.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from .openai_format import DONE, sse
from .worker_state import WORKER, Worker

__all__ = ["SglangFormat", "add_sglang_routes", "disaggregation_mode", "server_info"]

SGLANG_VERSION = "0.0.0-sim"
_VOCAB_IDS = 32_000


def _finish_reason(finish: str, completion_tokens: int) -> dict[str, Any]:
    # SGLang reports why it stopped as an object: the length hit, or the stop token matched.
    if finish == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": "stop", "matched": 2}


def _token_id(tok: str) -> int:
    return zlib.crc32(tok.encode()) % _VOCAB_IDS


class SglangFormat:
    """Formats one `/generate` answer; the same interface as `openai_format.AnswerFormat`."""

    def __init__(
        self, path: str, request_id: str, model: str, prompt_tokens: int, body: Mapping[str, Any]
    ) -> None:
        self.id = request_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.stream = body.get("stream") is True
        self.started = time.monotonic()
        self._text = ""
        self._ids: list[int] = []

    def _meta(self, finish: str | None, completion_tokens: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "finish_reason": None if finish is None else _finish_reason(finish, completion_tokens),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": 0,
            "e2e_latency": round(time.monotonic() - self.started, 6),
        }

    def role_event(self) -> bytes:
        return b""

    def events(self, tok: str, finish: str | None, sent: int) -> bytes:
        if tok:
            self._text += tok
            self._ids.append(_token_id(tok))
        obj = {
            "text": self._text,
            "output_ids": list(self._ids),
            "meta_info": self._meta(finish, sent),
        }
        return sse(obj) + (DONE if finish is not None else b"")

    def full(
        self,
        text: str,
        finish: str,
        completion_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        ids = [_token_id(" " + w) for w in text.split()]
        return {"text": text, "output_ids": ids, "meta_info": self._meta(finish, completion_tokens)}

    def __repr__(self) -> str:
        return f"SglangFormat({self.id!r}, stream={self.stream})"


def disaggregation_mode(worker: Worker) -> str:
    """SGLang's name of the role served now (after any role switch): "null" outside PD."""
    return _MODES.get(worker.role, "null")


_MODES = {"prefill": "prefill", "decode": "decode"}


def server_info(worker: Worker) -> dict[str, Any]:
    """SGLang's `/server_info`: its server args, internal states and version. As SGLang's
    (http_server.server_info: `server_args.resolved_dict()`), the top-level fields are the
    start-up configuration: after a role switch `disaggregation_mode` there still names the
    role it was started in; the role served now is each scheduler's, in `internal_states`
    (SGLang's InternalState._add_disaggregation)."""
    cfg, perf = worker.config, worker.perf
    mode = _MODES.get(cfg.role, "null")
    return {
        "model_path": cfg.model,
        "tokenizer_path": cfg.model,
        "served_model_name": cfg.model_name,
        "host": cfg.host,
        "port": cfg.port,
        "dtype": "bfloat16",
        "kv_cache_dtype": "auto",
        "context_length": worker.max_model_len,
        "tp_size": perf.tp_size,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": cfg.block_size,
        "enable_dp_attention": False,
        "disaggregation_mode": mode,
        "disaggregation_bootstrap_port": worker.bootstrap_port or cfg.bootstrap_port,
        "disaggregation_transfer_backend": "mooncake",
        "enable_pd_role_switch": cfg.role_switch,
        "max_total_num_tokens": worker.pool.capacity * cfg.block_size,
        "internal_states": [
            {
                "last_gen_throughput": 0.0,
                "memory_usage": {"kv_cache_usage": worker.pool.used / worker.pool.capacity},
                "disaggregation_mode": disaggregation_mode(worker),
            }
        ],
        "version": SGLANG_VERSION,
    }


def _json(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


async def _handle_server_info(request: web.Request) -> web.Response:
    return _json(server_info(request.app[WORKER]))


async def _handle_model_info(request: web.Request) -> web.Response:
    cfg = request.app[WORKER].config
    return _json(
        {
            "model_path": cfg.model,
            "tokenizer_path": cfg.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }
    )


async def _handle_get_load(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    waiting = worker.prefill.waiting + worker.engine.preempted
    running = worker.engine.running + worker.prefill.running
    tokens = worker.pool.used * worker.config.block_size
    return _json(
        [
            {
                "dp_rank": 0,
                "num_reqs": running + waiting,
                "num_waiting_reqs": waiting,
                "num_tokens": tokens,
            }
        ]
    )


async def _handle_health_generate(request: web.Request) -> web.Response:
    # Real SGLang runs a one-token generation; the sim's engine loop is the thing that could stall.
    return web.Response(status=200)


def add_sglang_routes(app: web.Application) -> None:
    app.router.add_get("/server_info", _handle_server_info)
    app.router.add_get("/get_server_info", _handle_server_info)
    app.router.add_get("/model_info", _handle_model_info)
    app.router.add_get("/get_model_info", _handle_model_info)
    app.router.add_get("/get_load", _handle_get_load)
    app.router.add_get("/health_generate", _handle_health_generate)
