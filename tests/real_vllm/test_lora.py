"""Issue 35 on real vLLM: LoRA adapters behind the router (docs/lora.md, "Real vLLM").

Two adapters for the tiny model are made at test time with `peft` (random weights, rank 8, on
the attention projections) in the real-vLLM venv. The package's engines run with `--enable-lora`
and runtime loading allowed (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`; tests/real_vllm/conftest.py):
`fr` is loaded on p0 and d0 through the engines' own API before the router starts, as an
operator's `--lora-modules` would have; `sql` is only in the router's catalog, so the router
loads it on both engines itself. Greedy answers under each adapter through the router are
exactly the decode engine's own answer under that adapter, and differ from the base model's
(the adapter really applies); the decode engine's counters show the prompt's KV came over NIXL,
not computed there. The adapters are unloaded again afterwards, for the package's other tests.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from router.config import merged_settings, settings_from_mapping
from tests.conftest import running_router
from tests.real_vllm.conftest import (
    LORA_RANK,
    MAX_LORAS,
    MODEL_DIR,
    PYTHON,
    SERVED,
    RealRouter,
    VllmCluster,
    VllmServer,
    missing_reason,
    router_settings,
    unique_prompt,
    wait_for,
)

pytestmark = pytest.mark.real_vllm

# Random LoRA weights (init_lora_weights=False: A and B both random, so the adapter changes the
# output) for the tiny model's attention projections, saved in peft's format.
MAKE_ADAPTERS = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
base, out, rank, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
for seed, name in enumerate(names, start=1):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=16, init_lora_weights=False, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    get_peft_model(model, config).save_pretrained(f"{out}/{name}")
"""


def _peft_missing() -> str | None:
    probe = subprocess.run(
        [str(PYTHON), "-c", "import importlib.util as u, sys; sys.exit(not u.find_spec('peft'))"],
        timeout=120,
    )
    if probe.returncode != 0:
        return "peft is not installed in the real-vLLM venv: run scripts/prepare_real_vllm.sh"
    return None


@pytest.fixture(scope="session")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two peft adapters of the tiny model, name -> directory."""
    reason = missing_reason() or _peft_missing()
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("loras")
    names = ("fr", "sql")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # One process for both: importing torch, transformers and peft is most of the cost.
    done = subprocess.run(
        [str(PYTHON), "-c", MAKE_ADAPTERS, str(MODEL_DIR), str(root), str(LORA_RANK), *names],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for name in names:
        assert (root / name / "adapter_model.safetensors").exists()
    return {name: root / name for name in names}


async def _adapter_call(
    session: aiohttp.ClientSession, server: VllmServer, verb: str, body: dict[str, str]
) -> tuple[int, str]:
    """vLLM's runtime adapter API: POST /v1/{verb}_lora_adapter (its answer is plain text)."""
    async with session.post(f"{server.url}/v1/{verb}_lora_adapter", json=body) as resp:
        return resp.status, await resp.text()


def _pair(cluster: VllmCluster) -> VllmCluster:
    """p0 and d0 only: the answers are checked against d0's own, and the router loads `sql`
    where it places it."""
    return VllmCluster(
        prefill=cluster.prefill, decodes=cluster.decodes[:1], workdir=cluster.workdir
    )


@pytest.fixture
async def lora_router(
    vllm_cluster: VllmCluster, adapters: dict[str, Path], redis_prefix: str
) -> AsyncIterator[RealRouter]:
    vllm_cluster.ensure_running()
    pair = _pair(vllm_cluster)
    async with aiohttp.ClientSession(trust_env=False) as session:
        try:
            for server in pair.servers:
                body = {"lora_name": "fr", "lora_path": str(adapters["fr"])}
                status, text = await _adapter_call(session, server, "load", body)
                assert status == 200, f"{server.name}: {status} {text}"
            raw = router_settings(pair, redis_prefix)
            for w in raw["workers"]:
                w.update(max_loras=MAX_LORAS, lora_runtime_loading=True)
            catalog = {"sql": {"path": str(adapters["sql"]), "base_model": SERVED}}
            raw = merged_settings(raw, {"lora": {"catalog": catalog, "poll_s": 1.0}})
            async with running_router(settings_from_mapping(raw)) as (url, app):
                yield RealRouter(url=url, app=app, cluster=pair)
        finally:
            # Whatever is loaded goes, on every engine (unknown ones answer 4xx: ignored).
            for server in vllm_cluster.servers:
                for name in ("fr", "sql"):
                    if server.alive():
                        await _adapter_call(session, server, "unload", {"lora_name": name})


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


async def _complete(
    client: AsyncOpenAI, model: str, prompt: str, extra_body: dict[str, str] | None = None
) -> str:
    c = await client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra_body
    )
    return c.choices[0].text


async def _parents(client: AsyncOpenAI) -> dict[str, Any]:
    return {m.id: getattr(m, "parent", None) for m in (await client.models.list()).data}


async def test_adapters_through_the_router_answer_as_one_engine_with_the_adapter(
    lora_router: RealRouter,
) -> None:
    r = lora_router
    decode = r.cluster.decodes[0]
    prompts = {name: unique_prompt(20, name) for name in ("fr", "sql")}
    async with _client(r.url) as via_router:
        # (a) The router lists both adapters, each with its base model as parent: `fr` read
        # from the engines' /v1/models, `sql` from its catalog.
        async def listed() -> Any:
            parents = await _parents(via_router)
            return True if parents == {SERVED: None, "fr": SERVED, "sql": SERVED} else parents

        await wait_for(listed, 30, "the router's /v1/models lists both adapters")

        # (b) Under each adapter, the router's greedy answer is the decode engine's alone; the
        # router loads `sql` on both engines first (only the catalog knew it).
        before = decode.prompt_tokens_by_source().get("external_kv_transfer", 0.0)
        answers = {
            name: await _complete(via_router, name, prompt) for name, prompt in prompts.items()
        }
        after = decode.prompt_tokens_by_source().get("external_kv_transfer", 0.0)
        assert after > before  # the prompts' KV came from the prefill engine over NIXL
        async with _client(decode.url) as alone:
            assert "sql" in await _parents(alone)  # loaded there by the router
            for name, prompt in prompts.items():
                salt = {"cache_salt": f"ref-{uuid.uuid4().hex}"}
                own = await _complete(alone, name, prompt, extra_body=salt)
                base = await _complete(alone, SERVED, prompt, extra_body=salt)
                assert answers[name] == own, name
                assert own != base, f"{name} does not change the tiny model's answer"
        async with _client(r.cluster.prefill.url) as prefill:
            assert "sql" in await _parents(prefill)

        # (c) An adapter no engine and no catalog knows: a 404 naming it, no engine asked.
        with pytest.raises(openai.NotFoundError) as missing:
            await _complete(via_router, "no-such-adapter", prompts["fr"])
        assert "no-such-adapter" in str(missing.value)
