"""deploy/: the RayService is valid against KubeRay's CRD schema, its Serve args build a tidal app config,
and the PodMonitor relabels Ray's metric names the way the dashboards expect."""
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
    crd = yaml.safe_load(path.read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


@pytest.mark.skipif(not CRD.exists(), reason="KubeRay CRDs (../shared/kuberay) not present")
def test_rayservice_matches_the_kuberay_crd():
    doc = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    jsonschema.validate(doc, crd_schema(CRD))
    bad = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, crd_schema(CRD))


def test_serve_config_builds_tidal_app_args():
    doc = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    app = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]
    assert app["import_path"] == "cluster.app:build_app"
    args = AppArgs(**app["args"])
    assert args.engine_kwargs["elastic"] in ("off", "elastic", "static")


def test_podmonitor_relabels_like_the_tests_prometheus():
    pm = yaml.safe_load((DEPLOY / "podmonitor.yaml").read_text())
    rule = pm["spec"]["podMetricsEndpoints"][0]["metricRelabelings"][0]
    want = RAY_METRIC_RELABEL_CONFIGS[0]
    assert rule["sourceLabels"] == want["source_labels"] and rule["regex"] == want["regex"]
    assert rule["replacement"] == want["replacement"] and rule["targetLabel"] == want["target_label"]
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert set(kust["resources"]) == {"rayservice.yaml", "podmonitor.yaml"}
