"""Deployment: docker-compose.yml is valid for Docker Compose, and the producer-side images
(gateway, callback worker) run without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import compose
import yaml

ROOT = Path(__file__).resolve().parent.parent
# The binary itself: the package's console-script wrapper drops the exit status.
COMPOSE = Path(compose.__file__).parent / "docker-compose"
REQUIRED_ENV = {"GENQ_MODEL_DIR": "/srv/models/llama", "GENQ_GATEWAY_TOKEN": "token",
                "GENQ_WEBHOOK_SECRET": "secret", "FLOWER_BASIC_AUTH": "admin:password"}


def compose_config(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {name: value for name, value in os.environ.items() if name not in REQUIRED_ENV}
    return subprocess.run([str(COMPOSE), "-f", str(ROOT / "docker-compose.yml"), "config", *args], cwd=ROOT,
                          env={**clean, **env}, capture_output=True, text=True, timeout=60)


def test_docker_compose_config_accepts_the_compose_file():
    checked = compose_config(REQUIRED_ENV, "--format", "json")
    assert checked.returncode == 0, checked.stderr
    services = json.loads(checked.stdout)["services"]
    assert services.keys() == {"redis", "worker", "flower", "gateway", "callbacks"}
    assert "--appendonly" in services["redis"]["command"] and services["redis"]["volumes"][0]["target"] == "/data"
    worker = services["worker"]
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    model_mount = next(v for v in worker["volumes"] if v["target"] == "/model")
    assert model_mount["source"] == "/srv/models/llama" and model_mount["read_only"]
    assert "engine_stats" in " ".join(worker["healthcheck"]["test"])
    assert services["flower"]["environment"]["FLOWER_BASIC_AUTH"] == "admin:password"
    assert services["callbacks"]["command"][-1] == "callback-worker"
    assert {s["environment"]["GENQ_REDIS_URL"] for s in services.values() if "environment" in s} == {
        "redis://redis:6379/0"}


def test_docker_compose_config_names_a_missing_secret():
    missing = compose_config({name: value for name, value in REQUIRED_ENV.items() if name != "GENQ_WEBHOOK_SECRET"})
    assert missing.returncode != 0 and "GENQ_WEBHOOK_SECRET" in missing.stderr


def test_gateway_and_callback_worker_import_and_parse_without_torch():
    code = ("import sys; sys.modules['torch'] = None; "
            "import producer.client, producer.gateway, producer.callbacks, producer.gateway.server; "
            "from worker.cli import build_parser; "
            "assert build_parser().parse_args(['gateway', '--port', '9']).port == 9")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_the_monitoring_profile_scrapes_every_worker_and_the_gateway_where_they_serve_metrics():
    checked = compose_config({**REQUIRED_ENV, "COMPOSE_PROFILES": "monitoring"}, "--format", "json")
    assert checked.returncode == 0, checked.stderr
    services = json.loads(checked.stdout)["services"]
    mount = next(v for v in services["prometheus"]["volumes"] if v["target"] == "/etc/prometheus/prometheus.yml")
    assert Path(mount["source"]) == ROOT / "deploy" / "prometheus.yml" and mount["read_only"]
    jobs = {job["job_name"]: job for job in yaml.safe_load(Path(mount["source"]).read_text())["scrape_configs"]}
    worker_port = int(services["worker"]["environment"]["GENQ_METRICS_PORT"])
    assert services["worker"]["expose"] == [str(worker_port)]
    assert jobs["genq-worker"]["dns_sd_configs"] == [{"names": ["worker"], "type": "A", "port": worker_port}]
    gateway_port = services["gateway"]["ports"][0]["target"]
    assert jobs["genq-gateway"]["static_configs"] == [{"targets": [f"gateway:{gateway_port}"]}]
    assert {job["metrics_path"] for job in jobs.values()} == {"/metrics"}
