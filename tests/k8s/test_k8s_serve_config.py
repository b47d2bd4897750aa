"""The serve arguments of each overlay: one source (the overlay's serve-config.yaml, through the
ConfigMap into spec.serveConfigV2), a Ray Serve config Ray accepts, `args` that parse as ServeArgs,
and an application `target_service.serving.deploy.app_builder` builds from them (the Serve Application
object only: no Ray starts)."""

from __future__ import annotations

import pytest
from ray.serve.schema import ServeDeploySchema

from target_service.serving.deploy import app_builder
from target_service.serving.serve_args import ServeArgs
from tests.k8s.manifests import K8S, OVERLAY_IDS, OVERLAYS, rendered

overlays = pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
KEY_FILES = ("api_key_file", "admin_token_file")


@overlays
def test_serve_config_has_one_source_the_overlays_file(overlay):
    result = rendered(overlay)
    text = (K8S / "overlays" / overlay / "serve-config.yaml").read_text()
    assert result.one("ConfigMap", "dflash-serve-config")["data"] == {"serveConfigV2": text}
    assert result.rayservice["spec"]["serveConfigV2"] == text


@overlays
def test_serve_config_is_one_ray_accepts(overlay):
    config = ServeDeploySchema(**rendered(overlay).serve_config)
    (application,) = config.applications
    assert (application.name, application.route_prefix) == ("dflash", "/")
    assert application.import_path == "target_service.serving.deploy:app_builder"
    assert config.http_options.host == "0.0.0.0"  # the pods' IPs, where the probes and Services come


def _args_with_key_files_in(tmp_path, args: dict) -> dict:
    """ServeArgs checks that the key files exist; they are mounted only in the pods, so the test
    points the two fields at files of the same names under tmp_path (the mount paths themselves are
    checked against the Secret's volume in test_k8s_manifests.py)."""
    args = dict(args)
    for field in KEY_FILES:
        stand_in = tmp_path / args[field].lstrip("/")
        stand_in.parent.mkdir(parents=True, exist_ok=True)
        stand_in.write_text("not-a-real-key\n")
        args[field] = str(stand_in)
    return args


@overlays
def test_serve_args_parse_as_serve_args(overlay, tmp_path):
    raw = rendered(overlay).serve_args
    args = ServeArgs(**_args_with_key_files_in(tmp_path, raw))
    assert args.model_dump(exclude=set(KEY_FILES), exclude_unset=True) == \
        {key: value for key, value in raw.items() if key not in KEY_FILES}
    assert args.host == "0.0.0.0" and args.admin_port == 50051
    assert args.port == rendered(overlay).serve_config["http_options"]["port"]


def test_serve_args_refuse_a_misspelt_field(tmp_path):
    raw = dict(rendered("gpu").serve_args, num_gpu_per_replica=1)
    with pytest.raises(ValueError, match="num_gpu_per_replica"):
        ServeArgs(**_args_with_key_files_in(tmp_path, raw))


def test_serve_args_refuse_a_missing_key_file():
    # in a pod without the Secret mounted, the application fails to build instead of serving keyless
    with pytest.raises(ValueError, match="api_key_file"):
        ServeArgs(**rendered("cpu-demo").serve_args)


@overlays
def test_app_builder_builds_the_application(overlay, tmp_path):
    raw = rendered(overlay).serve_args
    deployment = app_builder(_args_with_key_files_in(tmp_path, raw))._bound_deployment
    assert deployment.num_replicas == raw["replicas"]
    assert deployment.ray_actor_options["num_gpus"] == raw["num_gpus_per_replica"]
    assert deployment.ray_actor_options["num_cpus"] == raw["num_cpus_per_replica"]


def test_gpu_overlay_serves_qwen3_8b_with_its_drafter_in_bf16_on_cuda():
    args = rendered("gpu").serve_args
    assert (args["target"], args["drafter"]) == ("/models/qwen3-8b", "/models/qwen3-8b-dflash-b16")
    assert (args["dtype"], args["device"], args["num_gpus_per_replica"]) == ("bfloat16", "cuda", 1)


def test_cpu_demo_serves_the_built_in_demo_pair():
    args = rendered("cpu-demo").serve_args
    assert "target" not in args and "drafter" not in args
    assert ServeArgs.model_fields["target"].default is None  # None: the demo pair

