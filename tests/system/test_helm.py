"""The Helm chart (deploy/helm/disagg-router) and its examples, checked offline (issue 34).

`helm lint --strict`, `helm template` with the default values and every example values file;
every rendered object (and every example worker manifest) validated against the Kubernetes
1.33 schemas with kubernetes-validate in strict mode (an unknown field fails), the
ServiceMonitor and the KEDA ScaledObject against their CRDs' schemas (tests/system/crds/);
the router's own loader reads every rendered config with the environment the Deployment gives
it; bad values are refused by values.schema.json or the chart's checks; the pod's termination
grace outlasts the router's drain; RBAC grants only read verbs on what discovery reads; the
security context is the hardened one.

Without the helm binary (scripts/install_k8s_tools.sh puts it in
~/.cache/disagg-router/k8s-tools/bin; .ci/run runs it) the tests skip.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.paths import REPO

CHART = REPO / "deploy" / "helm" / "disagg-router"
EXAMPLES = REPO / "deploy" / "helm" / "examples"
CRDS = Path(__file__).parent / "crds"
KUBERNETES_VERSION = "1.33"
VALUES_FILES = sorted(EXAMPLES.glob("*.values.yaml"))
WORKER_FILES = sorted(EXAMPLES.glob("*.workers.yaml"))
# What the router does after its shutdown grace (router/edge/shutdown.py _CUT_WAIT_S 5 s, then
# aiohttp's shutdown_timeout 10 s: router/edge/server.py).
AFTER_GRACE_S = 15
SECRET_PASSWORD = "pa55-word"  # stands for what a Secret would hold, in the config check


def _helm() -> str | None:
    home = os.environ.get("K8S_TOOLS_HOME") or str(
        Path(os.environ.get("HOME", "/root")) / ".cache" / "disagg-router" / "k8s-tools"
    )
    local = Path(home) / "bin" / "helm"
    return str(local) if local.is_file() else shutil.which("helm")


HELM = _helm()
pytestmark = pytest.mark.skipif(
    HELM is None,
    reason="helm is not installed (bash scripts/install_k8s_tools.sh; .ci/run runs it)",
)


def _run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60, check=False)


@functools.cache
def render(values: str | None = None, *sets: str) -> tuple[dict[str, Any], ...]:
    """The chart's objects for a values file (None: the defaults) and --set overrides."""
    args = ["template", "r", str(CHART), "--namespace", "llm"]
    if values:
        args += ["-f", values]
    for item in sets:
        args += ["--set", item]
    done = _run_helm(*args)
    assert done.returncode == 0, done.stderr
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def refused(*sets: str, values: str | None = None) -> str:
    """helm template's error for values that must be refused."""
    args = ["template", "r", str(CHART)]
    if values:
        args += ["-f", values]
    for item in sets:
        args += ["--set", item]
    done = _run_helm(*args)
    assert done.returncode != 0, f"accepted: {sets}"
    return done.stderr


def of_kind(objects: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def router_deployment(objects: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    (dep,) = [
        o
        for o in of_kind(objects, "Deployment")
        if o["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    ]
    return dep


ALL_VALUES = [None, *(str(p) for p in VALUES_FILES)]
IDS = ["defaults", *(p.name for p in VALUES_FILES)]


def test_examples_exist() -> None:
    names = {p.name for p in VALUES_FILES}
    for needed in (
        "vllm-pd.values.yaml",
        "sglang-pd.values.yaml",
        "elastic-roles.values.yaml",
        "adopt-llm-d.values.yaml",
        "adopt-production-stack.values.yaml",
        "adopt-sglang-router.values.yaml",
    ):
        assert needed in names


@pytest.mark.parametrize("values", ALL_VALUES, ids=IDS)
def test_lint_strict(values: str | None) -> None:
    done = _run_helm("lint", "--strict", str(CHART), *(["-f", values] if values else []))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


# -- every object against its schema ----------------------------------------------------------


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    files = {
        "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
        "ScaledObject": "keda.sh_scaledobjects.yaml",
    }
    crd = yaml.safe_load((CRDS / files[kind]).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served")]
    return dict(version["schema"]["openAPIV3Schema"])


def validate(obj: dict[str, Any]) -> None:
    import jsonschema
    import kubernetes_validate

    if obj["kind"] in ("ServiceMonitor", "ScaledObject"):
        jsonschema.validate(obj, crd_schema(obj["kind"]))
        return
    # Raises ValidationError on a wrong or unknown field, SchemaNotFoundError on an unknown kind:
    # nothing rendered goes unchecked.
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("values", ALL_VALUES, ids=IDS)
def test_every_rendered_object_validates(values: str | None) -> None:
    objects = render(values)
    assert objects
    for obj in objects:
        validate(obj)


@pytest.mark.parametrize("path", WORKER_FILES, ids=[p.name for p in WORKER_FILES])
def test_worker_manifests_validate(path: Path) -> None:
    objects = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert objects
    for obj in objects:
        validate(obj)


def test_crd_validation_refuses_a_wrong_field() -> None:
    """The CRD check can fail: a ScaledObject without its target is refused."""
    import jsonschema

    objects = render(str(EXAMPLES / "vllm-pd.values.yaml"))
    (scaled, *_) = of_kind(objects, "ScaledObject")
    broken = json.loads(json.dumps(scaled))
    del broken["spec"]["scaleTargetRef"]
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    (monitor,) = of_kind(objects, "ServiceMonitor")
    broken = json.loads(json.dumps(monitor))
    broken["spec"]["endpoints"][0]["interval"] = "soon"
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_optional_objects_render_where_enabled() -> None:
    kinds = {o["kind"] for o in render(str(EXAMPLES / "vllm-pd.values.yaml"))}
    for kind in ("HorizontalPodAutoscaler", "ScaledObject", "ServiceMonitor", "Role"):
        assert kind in kinds
    quick = {o["kind"] for o in render(str(EXAMPLES / "sim-quickstart.values.yaml"))}
    assert "NetworkPolicy" in quick
    defaults = {o["kind"] for o in render(None)}
    assert defaults == {
        "ConfigMap",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
    }


# -- the router reads what the chart renders ----------------------------------------------------


def _container_env(dep: dict[str, Any]) -> dict[str, str]:
    """The router container's environment as Kubernetes would give it: a Secret's value is a
    stand-in, $(VAR) references expanded."""
    env: dict[str, str] = {}
    for var in dep["spec"]["template"]["spec"]["containers"][0].get("env") or []:
        if "valueFrom" in var:
            env[var["name"]] = SECRET_PASSWORD
        else:
            env[var["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"]
            )
    return env


@pytest.mark.parametrize("values", ALL_VALUES, ids=IDS)
def test_rendered_config_loads_with_the_router(values: str | None, tmp_path: Path) -> None:
    """The ConfigMap's file and the Deployment's environment through the router's own loader
    (what `serve` does before it listens: a bad config exits 2 there)."""
    from router.config import load_settings, read_config

    objects = render(values)
    (config_map,) = of_kind(objects, "ConfigMap")[:1]
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    raw = read_config(path)
    file_settings = load_settings(path, env={})
    # The `discovery:` values arrive as the router reads them (the chart's contract).
    assert file_settings.discovery.enabled == ("discovery" in raw)
    dep = router_deployment(objects)
    env = _container_env(dep)
    settings = load_settings(path, env=env)
    url = env.get("DISAGG_ROUTER_STORE_URL")
    if url is not None:
        assert settings.store.url == url  # the variable the chart sets is the one read
    if SECRET_PASSWORD in (url or ""):
        assert f":{SECRET_PASSWORD}@" in url  # type: ignore[operator]


# -- bad values are refused ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["replicaCount=0"], "/replicaCount"),
        (["surprise=1"], "additional properties 'surprise' not allowed"),
        (["redis.mode=sentinel"], "/redis/mode"),
        (["containerPort=80"], "/containerPort"),
        (["discovery.kind=consul"], "/discovery/kind"),
        (["discovery.adapter=tgi"], "/discovery/adapter"),
        (["autoscaling.targetCPUUtilizationPercentage=150"], "targetCPUUtilizationPercentage"),
        (["auth.adminTokenSecret.name=admin"], "adminTokenSecret"),
        (["redis.external.url=redis://:hunter2@redis:6379/0"], "/redis/external/url"),
        (["redis.external.url=http://redis:6379"], "/redis/external/url"),
        (["image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        (["probes.readiness.periodSeconds=0"], "/probes/readiness/periodSeconds"),
        (["terminationGrace.preStopSleepSeconds=0"], "preStopSleepSeconds"),
        (["config.server.shutdown_grace_s=-1"], "shutdown_grace_s"),
        (["config.discovery.kind=kubernetes"], "/config/discovery"),
        (
            [
                "keda.enabled=true",
                "keda.pools[0].name=both",
                "keda.pools[0].deployment=d",
                "keda.pools[0].minReplicas=1",
                "keda.pools[0].maxReplicas=2",
            ],
            "/keda/pools/0/name",
        ),
        (["discovery.prefill_selector=1"], "/discovery/prefill_selector"),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(v),
)
def test_schema_refuses_bad_values(sets: list[str], message: str) -> None:
    err = refused(*sets)
    assert "schema" in err, err
    assert message in err, err


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["terminationGrace.terminationGracePeriodSeconds=30"], "must be more than the router"),
        (["config.store.url=redis://r:6379/0"], "config.store.url"),
        (["config.redis_url=redis://r:6379/0"], "config.redis_url"),
        (["config.auth.admin_token=t0ken"], "config.auth.admin_token"),
        (["config.tenants[0].name=a", "config.tenants[0].keys[0]=sk-plain"], "sha256"),
        (["redis.mode=memory"], "replicaCount must be 1"),
        (["discovery.kind=kubernetes"], "needs at least one of"),
        (["redis.external.url="], "needs redis.external.url or"),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(v),
)
def test_chart_checks_refuse_bad_values(sets: list[str], message: str) -> None:
    assert message in refused(*sets)


def test_refused_values_say_where() -> None:
    """Several errors at once are all reported, each with its path."""
    err = refused("replicaCount=0", "service.type=Ingress")
    assert "/replicaCount" in err and "/service/type" in err


# -- shutdown, RBAC, security, secrets ----------------------------------------------------------


@pytest.mark.parametrize("values", ALL_VALUES, ids=IDS)
def test_termination_grace_outlasts_the_drain(values: str | None) -> None:
    objects = render(values)
    dep = router_deployment(objects)
    pod = dep["spec"]["template"]["spec"]
    cfg = yaml.safe_load(of_kind(objects, "ConfigMap")[0]["data"]["config.yaml"])
    grace = float((cfg.get("server") or {}).get("shutdown_grace_s", 20.0))
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 1
    assert pod["terminationGracePeriodSeconds"] > pre_stop + grace + AFTER_GRACE_S


def test_termination_grace_follows_shutdown_grace() -> None:
    pod = router_deployment(render(None, "config.server.shutdown_grace_s=91"))["spec"]
    # 5 s preStop + 91 s grace + 15 s + 10 s margin
    assert pod["template"]["spec"]["terminationGracePeriodSeconds"] == 121
    given = router_deployment(render(None, "terminationGrace.terminationGracePeriodSeconds=41"))
    assert given["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 41


@pytest.mark.parametrize("values", ALL_VALUES, ids=IDS)
def test_rbac_is_read_only_on_what_discovery_reads(values: str | None) -> None:
    objects = render(values)
    assert not of_kind(objects, "ClusterRole") and not of_kind(objects, "ClusterRoleBinding")
    roles = of_kind(objects, "Role")
    discovery = "kubernetes" in of_kind(objects, "ConfigMap")[0]["data"]["config.yaml"]
    dep = router_deployment(objects)
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is discovery
    if not discovery:
        assert roles == [] and of_kind(objects, "RoleBinding") == []
        return
    (role,) = roles
    for rule in role["rules"]:
        assert sorted(rule["verbs"]) == ["get", "list", "watch"]
        assert (rule["apiGroups"], rule["resources"]) in (
            ([""], ["pods"]),
            (["discovery.k8s.io"], ["endpointslices"]),
        )
    (binding,) = of_kind(objects, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == dep["spec"]["template"]["spec"]["serviceAccountName"]


def test_endpointslices_only_when_they_are_the_source() -> None:
    base = str(EXAMPLES / "vllm-pd.values.yaml")
    (pods,) = of_kind(render(base), "Role")
    assert [r["resources"] for r in pods["rules"]] == [["pods"]]
    (slices,) = of_kind(render(base, "discovery.source=endpointslices"), "Role")
    assert [r["resources"] for r in slices["rules"]] == [["pods"], ["endpointslices"]]


@pytest.mark.parametrize("values", ALL_VALUES, ids=IDS)
def test_security_context_is_hardened(values: str | None) -> None:
    for dep in of_kind(render(values), "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["capabilities"] == {"drop": ["ALL"]}
    router = router_deployment(render(values))["spec"]["template"]["spec"]
    assert router["containers"][0]["securityContext"]["runAsNonRoot"] is True
    mounts = {m["mountPath"] for m in router["containers"][0]["volumeMounts"]}
    assert "/tmp" in mounts  # the only writable path


@pytest.mark.parametrize("values", ALL_VALUES, ids=IDS)
def test_secrets_only_by_reference(values: str | None) -> None:
    objects = render(values)
    assert of_kind(objects, "Secret") == []
    dep = router_deployment(objects)
    for var in dep["spec"]["template"]["spec"]["containers"][0].get("env") or []:
        if var["name"] in ("DISAGG_REDIS_PASSWORD",) or "TOKEN" in var["name"]:
            assert "secretKeyRef" in var["valueFrom"]
        if "value" in var:
            assert not re.search(r"://[^/@]*:[^$/@][^/@]*@", var["value"]), var


def test_probes_and_prestop() -> None:
    container = router_deployment(render(None))["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["args"][:3] == ["serve", "--config", "/etc/disagg-router/config.yaml"]


def test_dashboard_config_map_is_the_dashboard() -> None:
    objects = render(str(EXAMPLES / "vllm-pd.values.yaml"))
    (board,) = [
        o for o in of_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("dashboard")
    ]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = REPO / "deploy" / "grafana" / "dashboards" / "disagg-router.json"
    assert json.loads(board["data"]["disagg-router.json"]) == json.loads(source.read_text())


def test_keda_scales_pools_on_the_router_recommendation() -> None:
    objects = render(str(EXAMPLES / "vllm-pd.values.yaml"))
    targets = {}
    for scaled in of_kind(objects, "ScaledObject"):
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        assert "disagg_router_scaling_recommended_replicas" in trigger["metadata"]["query"]
        targets[scaled["spec"]["scaleTargetRef"]["name"]] = trigger["metadata"]["query"]
    assert set(targets) == {"vllm-prefill", "vllm-decode"}
    assert 'pool="decode"' in targets["vllm-decode"]
    from router.metrics import RouterMetrics

    assert b"disagg_router_scaling_recommended_replicas" in RouterMetrics().render()


def test_secret_variables_are_the_ones_the_router_reads(tmp_path: Path) -> None:
    """Each Secret reference lands in the variable the router's loader reads for that setting
    (DISAGG_ROUTER_<GROUP>_<FIELD>), and the Redis password inside the URL."""
    from router.config import load_settings

    objects = render(
        None,
        "redis.external.passwordSecret.name=redis",
        "redis.external.passwordSecret.key=password",
        "auth.apiKeysSecret.name=clients",
        "auth.apiKeysSecret.key=keys",
    )
    path = tmp_path / "config.yaml"
    path.write_text(of_kind(objects, "ConfigMap")[0]["data"]["config.yaml"])
    settings = load_settings(path, env=_container_env(router_deployment(objects)))
    assert settings.store.url == f"redis://:{SECRET_PASSWORD}@redis:6379/0"
    assert [k.reveal() for k in settings.auth.api_keys] == [SECRET_PASSWORD]
    assert SECRET_PASSWORD not in json.dumps(objects)  # by reference only


def test_admin_tokens_from_their_secrets_load(tmp_path: Path) -> None:
    from router.config import load_settings

    objects = render(
        None,
        "auth.adminTokenSecret.name=admin",
        "auth.adminTokenSecret.key=token",
        "auth.adminReadTokenSecret.name=reader",
        "auth.adminReadTokenSecret.key=token",
    )
    path = tmp_path / "config.yaml"
    path.write_text(of_kind(objects, "ConfigMap")[0]["data"]["config.yaml"])
    settings = load_settings(path, env=_container_env(router_deployment(objects)))
    assert settings.auth.admin_token.reveal() == SECRET_PASSWORD
    assert settings.auth.admin_read_token.reveal() == SECRET_PASSWORD
