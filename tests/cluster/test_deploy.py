"""deploy/: the RayService is valid against KubeRay's CRD schema, its Serve args build a tidal app config, it is
safe (API key and Ray token from Secrets, Ray token authentication, the dashboard reachable by the operator only, a
termination grace period above the drain, the HAProxy front door), and the PodMonitor relabels Ray's metric names
the way the dashboards expect."""
from pathlib import Path

import jsonschema
import pytest
import yaml

from cluster.app import AppArgs
from cluster.metrics import RAY_METRIC_RELABEL_CONFIGS
from tests.support import REPO

DEPLOY = REPO / "deploy"
CRD = REPO.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"


def crd_schema(path: Path, version: str = "v1") -> dict:
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))   # a 14,000-line file
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not CRD.exists(), reason="KubeRay CRDs (../shared/kuberay) not present")
def test_rayservice_matches_the_kuberay_crd():
    schema = crd_schema(CRD)
    validator = jsonschema.validators.validator_for(schema)(schema)   # checking the CRD's own schema takes long
    doc = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    validator.validate(doc)
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(doc)


def test_serve_config_builds_tidal_app_args():
    doc = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    app = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]
    assert app["import_path"] == "cluster.app:build_app"
    args = AppArgs(**app["args"])
    assert args.engine_kwargs["elastic"] in ("off", "elastic", "static")


def rayservice() -> dict:
    return yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())


def pod_templates(doc: dict) -> list[dict]:
    cluster = doc["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.timeout(30)
def test_every_ray_container_takes_its_secrets_from_secrets_and_runs_the_haproxy_front_door():
    doc = rayservice()
    containers = [c for t in pod_templates(doc) for c in t["spec"]["containers"]]
    assert containers
    for container in containers:
        env = env_of(container)
        assert env["TIDAL_API_KEY"] == {"secretKeyRef": {"name": "tidal-api-key", "key": "api-key"}}
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": "tidal-ray-auth", "key": "auth_token"}}
        assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        assert not any("value" in e and ("KEY" in e["name"] or "TOKEN" in e["name"]) for e in container["env"])
    # The operator authenticates with the same Secret the pods read.
    assert doc["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "tidal-ray-auth"}


@pytest.mark.timeout(30)
def test_the_grace_period_outlasts_the_drain():
    doc = rayservice()
    app = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]
    drain_s = AppArgs(**app["args"]).graceful_shutdown_timeout_s
    assert drain_s == 120
    for template in pod_templates(doc):
        assert template["spec"]["terminationGracePeriodSeconds"] > drain_s


@pytest.mark.timeout(30)
def test_the_dashboard_is_reachable_by_the_operator_only():
    head = rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]
    policy = yaml.safe_load((DEPLOY / "networkpolicy.yaml").read_text())
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() >= head["template"]["metadata"]["labels"].items()
    assert policy["spec"]["podSelector"]["matchLabels"]["ray.io/node-type"] == "head"
    open_ports = {p["port"] for rule in policy["spec"]["ingress"] if "from" not in rule for p in rule["ports"]}
    assert open_ports == {8000, 8080}                         # the front door and the metrics, nothing else
    dashboard = next(p["containerPort"] for c in head["template"]["spec"]["containers"] for p in c["ports"]
                     if p["name"] == "dashboard")
    [operator_rule] = [r for r in policy["spec"]["ingress"] if any(p["port"] == dashboard for p in r.get("ports", []))]
    [peer] = operator_rule["from"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}


def test_podmonitor_relabels_like_the_tests_prometheus():
    pm = yaml.safe_load((DEPLOY / "podmonitor.yaml").read_text())
    rule = pm["spec"]["podMetricsEndpoints"][0]["metricRelabelings"][0]
    want = RAY_METRIC_RELABEL_CONFIGS[0]
    assert rule["sourceLabels"] == want["source_labels"] and rule["regex"] == want["regex"]
    assert rule["replacement"] == want["replacement"] and rule["targetLabel"] == want["target_label"]
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert set(kust["resources"]) == {"rayservice.yaml", "podmonitor.yaml", "networkpolicy.yaml"}


@pytest.mark.timeout(30)
def test_serve_autoscales_the_replicas_and_the_controller_tunes_them():
    doc = rayservice()
    app = AppArgs(**yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"])
    scaling = app.autoscaling_config
    assert 1 <= scaling["min_replicas"] < scaling["max_replicas"] and scaling["target_ongoing_requests"] > 0
    assert doc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    workers = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert workers["maxReplicas"] >= scaling["max_replicas"]           # a GPU worker per replica at the most
    assert app.controller.policy == "auto" and app.controller.app_name == "tidal"
