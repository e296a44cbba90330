"""The shipped YAMLs pass Ray's own validation: `ray up`'s config check and Serve's deploy schema,
and the Serve config's import path builds the application."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_cluster_yaml_passes_rays_validator():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    prepared = prepare_config(copy.deepcopy(config))  # what `ray up` does before validating
    validate_config(prepared)
    types = prepared["available_node_types"]
    assert set(types) == {"head", "prefill_gpu", "decode_gpu"}
    assert types["decode_gpu"]["resources"]["GPU"] >= 2 and types["prefill_gpu"]["resources"]["GPU"] >= 1


def test_cluster_validator_rejects_a_broken_copy():
    """The validation above can fail: a node type with an unknown field is refused."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    config["available_node_types"]["decode_gpu"]["gpus_please"] = 4
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))


def test_serve_yaml_matches_serves_schema_and_builds(tiny_model_dir):
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.utils import import_attr
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((DEPLOY / "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    (app,) = schema.applications
    assert app.import_path == "deploy.app:build_app"
    args = dict(app.args, model=tiny_model_dir, device="cpu", dtype=None)  # the YAML's model path is the cluster's
    built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), args)
    assert isinstance(built, Application)


def test_serve_yaml_args_are_checked(tiny_model_dir):
    from deploy.config import TandemConfig

    raw = yaml.safe_load((DEPLOY / "serve.yaml").read_text())
    args = dict(raw["applications"][0]["args"], model=tiny_model_dir)
    TandemConfig(**args)
    assert set(args) <= set(TandemConfig.model_fields)
    with pytest.raises(ValueError, match="max_num_seq"):
        TandemConfig(**dict(args, max_num_seq=8))  # a misspelt key is refused, not ignored
    with pytest.raises(ValueError, match="not a model directory"):
        TandemConfig(**dict(args, model="/nonexistent"))
    with pytest.raises(ValueError, match="tp"):
        TandemConfig(**dict(args, tp=0))
