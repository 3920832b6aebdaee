"""The files in deploy/ stay true: the HAProxy configuration is what `duplexd cluster` writes, and HAProxy
accepts it; the Kubernetes manifest probes /readyz and names each pod as its node."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from duplexd.cluster import Worker, haproxy_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def shipped_haproxy_config() -> str:
    workers = [Worker(f"w{i}", "127.0.0.1", 8100 + i) for i in (1, 2, 3)]
    return haproxy_config(workers, host="127.0.0.1", port=8000, stats_port=8404)


def test_the_shipped_haproxy_config_is_the_generated_one() -> None:
    shipped = (DEPLOY / "haproxy.cfg").read_text()
    generated = shipped_haproxy_config()
    # (the shipped file's header says how it was made; the rest is the generator's output)
    assert shipped.split("\nglobal\n", 1)[1] == generated.split("\nglobal\n", 1)[1]


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (scripts/install-test-deps)")
def test_haproxy_accepts_the_config() -> None:
    check = subprocess.run(["haproxy", "-c", "-f", str(DEPLOY / "haproxy.cfg")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_kubernetes_manifest_probes_readiness_and_names_the_node() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text())}
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    env = {e["name"]: e for e in container["env"]}
    assert env["DUPLEXD_TRANSPORT__NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
