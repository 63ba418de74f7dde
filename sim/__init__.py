"""disagg-router: sim — the simulated GPU worker and its deterministic toy model."""

from .faults import FaultConfig
from .textgen import expected_answer, generate, prompt_context
from .worker import create_worker_app, run_worker, running_worker
from .worker_config import WorkerConfig, add_worker_arguments, config_from_args

__all__ = [
    "FaultConfig",
    "WorkerConfig",
    "add_worker_arguments",
    "config_from_args",
    "create_worker_app",
    "expected_answer",
    "generate",
    "prompt_context",
    "run_worker",
    "running_worker",
]
