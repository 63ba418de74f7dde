"""Configuration of one simulated GPU worker, and its command-line flags.

`disagg-router worker --role prefill|decode|both --port N ...` builds a WorkerConfig with
`add_worker_arguments` + `config_from_args`; tests build one directly.
"""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass, field

from policies.costmodel import GPUS, MODELS

from .faults import ERROR_STATUSES, GARBAGE_LEGS, GARBAGE_SHAPES, FaultConfig
from .lora import LoraConfig, parse_lora_modules

__all__ = ["ROLES", "WorkerConfig", "add_worker_arguments", "config_from_args"]

ROLES = ("prefill", "decode", "both")


def _new_engine_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 0  # 0 = ephemeral
    worker_id: str = ""
    model: str = "llama-3-8b"  # a policies.costmodel profile
    served_model_name: str | None = None  # None = model
    gpu: str = "h100"
    tp_size: int | None = None  # None = the model profile's default
    block_size: int = 16
    kv_blocks: int | None = None  # KV capacity override; None = from the cost model
    time_scale: float = 1.0  # 1 = real time, 100 = 100x faster
    mean_output_tokens: int = 128
    kv_lease_s: float = 30.0  # simulated seconds a prefilled KV waits for its decode
    engine_id: str = field(default_factory=_new_engine_id)
    max_model_len: int | None = None  # None = the model profile's
    faults: FaultConfig = field(default_factory=FaultConfig)
    # SGLang PD: a prefill worker's bootstrap listener (0 = ephemeral, None = none; sim.bootstrap)
    bootstrap_port: int | None = None
    # KV events on vLLM's wire format (sim.kv_events): the PUB and replay addresses it binds
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    # A model directory whose tokenizer.json names text prompts' KV blocks (sim.kv_events);
    # None = the sim's own ids (crc32 of 4-character pieces)
    tokenizer: str | None = None
    # SGLang's --enable-pd-role-switch: POST /pd_role_switch flips prefill <-> decode at run time
    # (sim.role_switch); the bootstrap listener then runs in decode mode too (sim.bootstrap).
    role_switch: bool = False
    role_switch_s: float = 1.0  # simulated seconds a flip's teardown and rebuild take
    # Simulated seconds between the flip and its answer: SGLang's scheduler reports the new role
    # (/server_info) before the tokenizer manager's answer to the caller is back.
    role_switch_reply_s: float = 0.0
    # LoRA adapters as vLLM serves them (sim.lora): --enable-lora, --max-loras, --lora-modules
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.model not in MODELS:
            raise ValueError(f"unknown model profile {self.model!r}; known: {sorted(MODELS)}")
        if self.gpu not in GPUS:
            raise ValueError(f"unknown GPU profile {self.gpu!r}; known: {sorted(GPUS)}")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError("kv_blocks must be >= 1")
        if self.kv_lease_s <= 0:
            raise ValueError("kv_lease_s must be > 0")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be within [0, 65535]")
        if self.bootstrap_port is not None and not 0 <= self.bootstrap_port < 65536:
            raise ValueError("bootstrap_port must be within [0, 65535]")
        if self.role_switch_s < 0:
            raise ValueError("role_switch_s must be >= 0")
        if self.role_switch_reply_s < 0:
            raise ValueError("role_switch_reply_s must be >= 0")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def name(self) -> str:
        # The role it started in: a role switch (sim.role_switch) keeps the worker's identity.
        return self.worker_id or f"{self.role}-{self.engine_id[:8]}"


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `disagg-router worker`."""
    d = WorkerConfig.__dataclass_fields__
    parser.add_argument("--role", choices=ROLES, default=d["role"].default)
    parser.add_argument("--host", default=d["host"].default)
    parser.add_argument("--port", type=int, default=d["port"].default, help="0 = ephemeral")
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--model", default=d["model"].default, choices=sorted(MODELS))
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--gpu", default=d["gpu"].default, choices=sorted(GPUS))
    parser.add_argument("--tp-size", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=d["block_size"].default)
    parser.add_argument("--kv-blocks", type=int, default=None, help="override KV capacity")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="simulated seconds per real second"
    )
    parser.add_argument("--mean-output-tokens", type=int, default=d["mean_output_tokens"].default)
    parser.add_argument("--kv-lease-s", type=float, default=d["kv_lease_s"].default)
    parser.add_argument("--engine-id", default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--bootstrap-port", type=int, default=None, help="SGLang PD bootstrap port (0 = ephemeral)"
    )
    parser.add_argument(
        "--kv-events-endpoint", default=None, help="publish KV events here (tcp://127.0.0.1:N)"
    )
    parser.add_argument("--kv-events-replay-endpoint", default=None, help="KV-event replay")
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="with --kv-events-endpoint: name text prompts' blocks by DIR/tokenizer.json's ids",
    )
    parser.add_argument(
        "--enable-pd-role-switch",
        dest="role_switch",
        action="store_true",
        help="serve POST /pd_role_switch (SGLang 0.5.23); bootstrap listener on decode too",
    )
    parser.add_argument(
        "--role-switch-s",
        type=float,
        default=d["role_switch_s"].default,
        help="simulated seconds a role switch takes",
    )
    parser.add_argument(
        "--role-switch-reply-s",
        type=float,
        default=d["role_switch_reply_s"].default,
        help="simulated seconds from a switch's flip to its answer (the new role shows first)",
    )
    lora = parser.add_argument_group("LoRA adapters (vLLM's flags; sim.lora)")
    lora.add_argument("--enable-lora", action="store_true")
    lora.add_argument("--max-loras", type=int, default=1, help="adapters resident at once (LRU)")
    lora.add_argument("--lora-modules", nargs="*", default=None, metavar="NAME=PATH")
    lora.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="serve /v1/load_lora_adapter (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
    )
    lora.add_argument(
        "--lora-load-s", type=float, default=0.5, help="simulated seconds a load takes"
    )
    faults = parser.add_argument_group("fault injection")
    faults.add_argument("--fault-prefill-fail", action="store_true")
    faults.add_argument("--fault-prefill-die-after-kv", action="store_true")
    faults.add_argument("--fault-decode-fail-before-first", action="store_true")
    faults.add_argument("--fault-decode-die-after-tokens", type=int, default=None, metavar="N")
    faults.add_argument("--fault-hang", action="store_true")
    faults.add_argument(
        "--fault-hang-after-tokens", type=int, default=None, metavar="N", help="then silence"
    )
    faults.add_argument(
        "--fault-garbage", choices=GARBAGE_SHAPES, default=None, help="/health stays fine"
    )
    faults.add_argument("--fault-garbage-leg", choices=GARBAGE_LEGS, default="any")
    faults.add_argument("--fault-slow-factor", type=float, default=1.0)
    faults.add_argument("--fault-error-rate", type=float, default=0.0)
    faults.add_argument(
        "--fault-error-status",
        default="500",
        choices=[str(s) for s in ERROR_STATUSES],
    )
    faults.add_argument(
        "--fault-role-switch-fail",
        type=float,
        default=0.0,
        metavar="P",
        help="probability a role switch fails after the teardown (instance left unhealthy)",
    )
    faults.add_argument("--fault-seed", type=int, default=0)
    faults.add_argument("--fault-count", type=int, default=None, help="each fault fires N times")


def config_from_args(ns: argparse.Namespace) -> WorkerConfig:
    status: int | str = ns.fault_error_status
    if isinstance(status, str) and status.isdigit():
        status = int(status)
    faults = FaultConfig(
        prefill_fail=ns.fault_prefill_fail,
        prefill_die_after_kv=ns.fault_prefill_die_after_kv,
        decode_fail_before_first=ns.fault_decode_fail_before_first,
        decode_die_after_tokens=ns.fault_decode_die_after_tokens,
        hang=ns.fault_hang,
        hang_after_tokens=ns.fault_hang_after_tokens,
        garbage=ns.fault_garbage,
        garbage_leg=ns.fault_garbage_leg,
        slow_factor=ns.fault_slow_factor,
        error_rate=ns.fault_error_rate,
        error_status=status,
        role_switch_fail=ns.fault_role_switch_fail,
        seed=ns.fault_seed,
        count=ns.fault_count,
    )
    extra = {"engine_id": ns.engine_id} if ns.engine_id else {}
    return WorkerConfig(
        role=ns.role,
        host=ns.host,
        port=ns.port,
        worker_id=ns.worker_id,
        model=ns.model,
        served_model_name=ns.served_model_name,
        gpu=ns.gpu,
        tp_size=ns.tp_size,
        block_size=ns.block_size,
        kv_blocks=ns.kv_blocks,
        time_scale=ns.time_scale,
        mean_output_tokens=ns.mean_output_tokens,
        kv_lease_s=ns.kv_lease_s,
        max_model_len=ns.max_model_len,
        faults=faults,
        bootstrap_port=ns.bootstrap_port,
        kv_events_endpoint=ns.kv_events_endpoint,
        kv_events_replay_endpoint=ns.kv_events_replay_endpoint,
        tokenizer=ns.tokenizer,
        role_switch=ns.role_switch,
        role_switch_s=ns.role_switch_s,
        role_switch_reply_s=ns.role_switch_reply_s,
        lora=LoraConfig(
            enabled=ns.enable_lora,
            max_loras=ns.max_loras,
            modules=parse_lora_modules(ns.lora_modules),
            runtime_loading=ns.allow_runtime_lora,
            load_s=ns.lora_load_s,
        ),
        **extra,
    )
