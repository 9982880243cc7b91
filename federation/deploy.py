"""`fedserve deploy CONFIG`: `serve deploy` with our checks first.

Serve's ServeDeploySchema accepts unknown keys (forward compatibility), and an application's
`args` reach FederationConfig only inside the cluster, so a typo would surface as a failed
deployment minutes later. Here the file is checked before it is sent: Serve's schema, no key
Serve would ignore, and every fedserve application's args through FederationConfig.
"""

from __future__ import annotations

BUILDER = "federation.app:build_app"
DEFAULT_ADDRESS = "http://127.0.0.1:8265"  # the Ray dashboard on the head, where Serve's API is


def check(config: dict):
    """The validated ServeDeploySchema; raises ValueError naming the first problem."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    from federation.config import FederationConfig

    if not isinstance(config, dict):
        raise ValueError("a Serve config is a mapping with an `applications` list")
    unknown = set(config) - set(ServeDeploySchema.model_fields)
    for app in config.get("applications") or ():
        unknown |= {f"applications[].{k}" for k in set(app) - set(ServeApplicationSchema.model_fields)}
    if unknown:
        raise ValueError(f"unknown keys (Serve would ignore them): {sorted(unknown)}")
    try:
        schema = ServeDeploySchema.model_validate(config)
        for app in schema.applications:
            if app.import_path == BUILDER:
                FederationConfig(**app.args)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None
    return schema


def load(path: str) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


def deploy(path: str, address: str = DEFAULT_ADDRESS) -> None:
    """Check the Serve config file and send it to the Serve API at `address` (the dashboard)."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    schema = check(load(path))
    ServeSubmissionClient(address).deploy_applications(schema.model_dump(exclude_unset=True))
