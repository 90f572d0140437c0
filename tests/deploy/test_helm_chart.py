"""The Helm chart (helm/etrain), rendered and linted by the real Helm engine for a matrix of values.

Every entry of MATRIX is rendered once (tests/deploy/chart.py caches it) and then: linted strictly
for Kubernetes 1.30, every core object validated against the 1.30 schemas (strict: unknown fields
are errors), the RayCluster checked against the fields KubeRay documents, and the facts a working
install depends on asserted on the rendered objects: the checkpoint claim every pod shares, the
environment the server is configured from (read back through the server's own ``Settings``), the
token Secret, probes that the real app answers, GPUs, security contexts and network policies.
"""

from __future__ import annotations

import copy
import re
import tempfile
import tomllib
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient

from etrain.api.app import create_app
from etrain.service.settings import Settings
from etrain.service.store.job_store import JobStore
from tests.deploy import chart
from tests.deploy.chart import ROOT, as_pod_template, containers, labels_match, render, resolve_env
from tests.deploy.kuberay_fields import check_raycluster
from tests.fakes import InMemoryManager

#: Secrets the "existing" entries name: created by the operator outside the chart, so the test supplies them.
EXTERNAL_SECRETS = {
    "etrain-admin": {"token": "Admin-token-from-a-vault-0123456789"},
    "etrain-s3": {
        "AWS_ACCESS_KEY_ID": "AKIAEXISTING",
        "AWS_SECRET_ACCESS_KEY": "existing/secret+key",
        "AWS_DEFAULT_REGION": "eu-west-1",
    },
    "etrain-tenants": {"api-tokens": "alice=Alice-token-0123456789\nbob=Bob-token-0123456789\n"},
}
S3_INLINE = {
    "checkpoint": {
        "path": "s3://etrain-ckpt/team-a",
        "s3": {
            "accessKeyId": "AKIAINLINE",
            "secretAccessKey": "inline/secret+key",
            "endpointUrl": "http://minio.minio.svc:9000",
            "region": "us-east-1",
        },
    }
}

MATRIX = {
    "cpu-default": {},
    "gpu": {
        "image": {"tag": "0.1.0-cuda"},
        "rayCluster": {"workerGroups": {"gpu": {"enabled": True, "maxReplicas": 3, "gpus": 4}}},
    },
    "autoscaling-off": {
        "rayCluster": {"enableInTreeAutoscaling": False, "workerGroups": {"cpu": {"replicas": 3, "maxReplicas": 3}}}
    },
    "ingress": {
        "ingress": {
            "enabled": True,
            "host": "etrain.example.com",
            "className": "nginx",
            "annotations": {"cert-manager.io/cluster-issuer": "letsencrypt"},
        }
    },
    "ingress-no-tls": {"ingress": {"enabled": True, "host": "etrain.internal", "tls": {"enabled": False}}},
    "monitoring": {
        "monitoring": {
            "serviceMonitor": {
                "enabled": True,
                "scrapeWithToken": True,
                "labels": {"release": "kube-prometheus-stack"},
            },
            "podMonitor": {"enabled": True},
            "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "etrain"}},
        }
    },
    "existing-secret": {
        "auth": {
            "existingSecret": "etrain-admin",
            "secretKey": "token",
            "tenantTokens": {"existingSecret": "etrain-tenants"},
        }
    },
    "generated-token": {"auth": {"enabled": False}},
    "existing-claim": {"checkpoint": {"existingClaim": "team-nfs", "path": "/mnt/ckpt"}},
    "s3": S3_INLINE,
    "s3-existing-secret": {"checkpoint": {"path": "s3://etrain-ckpt", "s3": {"existingSecret": "etrain-s3"}}},
    "s3-token-cache": {**S3_INLINE, "tokenCache": {"existingClaim": "etrain-tokens", "maxGB": "250"}},
    "external-ray": {"rayCluster": {"enabled": False}, "controlPlane": {"rayAddress": "ray://ray-head.ray.svc:10001"}},
    "everything": {
        "image": {"tag": "0.1.0-cuda"},
        "auth": {"existingSecret": "etrain-admin", "secretKey": "token"},
        "ingress": {"enabled": True, "host": "etrain.example.com"},
        "monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
        "checkpoint": {"existingClaim": "team-nfs"},
        "sharedVolumes": [
            {
                "name": "datasets",
                "mountPath": "/datasets",
                "readOnly": True,
                "volume": {"persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
            }
        ],
        "rayCluster": {
            "enableInTreeAutoscaling": False,
            "autoscalerOptions": {"idleTimeoutSeconds": 120},
            "gcsFaultToleranceOptions": {"redisAddress": "redis.etrain.svc:6379"},
            "workerGroups": {
                "gpu": {"enabled": True, "replicas": 2, "gpus": 8},
                "big-cpu": {
                    "enabled": True,
                    "replicas": 1,
                    "minReplicas": 0,
                    "maxReplicas": 2,
                    "resources": {"limits": {"cpu": "32"}},
                },
            },
        },
    },
}
CASES = list(MATRIX)
S3_CASES = [case for case in CASES if str(MATRIX[case].get("checkpoint", {}).get("path", "")).startswith("s3://")]
VOLUME_CASES = [case for case in CASES if case not in S3_CASES]


def rendered(case: str) -> chart.Rendered:
    return render(MATRIX[case])


def merged_values(case: str) -> dict:
    return chart.deep_merge(yaml.safe_load((chart.CHART / "values.yaml").read_text()), MATRIX[case])


def control_plane(case: str) -> dict:
    return rendered(case).one("Deployment")["spec"]["template"]["spec"]["containers"][0]


def server_settings(case: str, **overrides) -> Settings:
    """The server's Settings exactly as `etrain serve` builds them from the rendered container's environment.

    A file the environment names inside a mounted Secret (the tenant tokens) is materialised from that
    Secret into a temporary folder, as the kubelet would mount it."""
    env = resolve_env(control_plane(case), rendered(case), EXTERNAL_SECRETS)
    pod = rendered(case).one("Deployment")["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for mount in pod["containers"][0]["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        for name, value in env.items():
            if secret and Path(value).parent == Path(mount["mountPath"]):
                key = next(item["key"] for item in secret["items"] if item["path"] == Path(value).name)
                folder = Path(tempfile.mkdtemp(prefix="etrain-secret-"))
                (folder / Path(value).name).write_text(EXTERNAL_SECRETS[secret["secretName"]][key])
                env[name] = str(folder / Path(value).name)
    return Settings.from_env(env, **overrides)


# ---------------------------------------------------------------- the engine: lint and schemas


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_strict_passes(case):
    report = chart.lint(MATRIX[case])
    assert report["errors"] == []
    # severity 1 is informational ("icon is recommended"); warnings (2) and errors (3) fail
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("case", CASES)
def test_every_core_object_validates_against_kubernetes_1_30(case):
    r = rendered(case)
    core = [obj for obj in r.objects if (obj["apiVersion"], obj["kind"]) not in chart.CUSTOM_KINDS]
    assert {obj["kind"] for obj in core} >= {"Deployment", "Service", "ServiceAccount", "NetworkPolicy"}
    for obj in core:
        chart.validate(obj)
    for role, template in r.pod_templates().items():
        chart.validate(as_pod_template(role.replace("/", "-"), template))


@pytest.mark.parametrize("case", CASES)
def test_raycluster_uses_only_fields_kuberay_documents(case):
    r = rendered(case)
    if not merged_values(case)["rayCluster"]["enabled"]:
        assert not r.has("RayCluster")
        return
    cluster = r.one("RayCluster")
    assert check_raycluster(cluster) == []
    options = cluster["spec"].get("autoscalerOptions")
    if options:
        # autoscalerOptions' Kubernetes-typed fields, validated as the container KubeRay builds from them
        head = cluster["spec"]["headGroupSpec"]["template"]
        sidecar = {
            "name": "autoscaler",
            "image": "x",
            **{
                k: options[k]
                for k in ("securityContext", "env", "envFrom", "volumeMounts", "resources")
                if k in options
            },
        }
        pod = {"metadata": {}, "spec": {"containers": [sidecar], "volumes": head["spec"]["volumes"]}}
        chart.validate(as_pod_template("autoscaler", pod))
        volumes = {volume["name"] for volume in head["spec"]["volumes"]}
        assert {mount["name"] for mount in options.get("volumeMounts", [])} <= volumes


def test_the_validators_are_strict():
    """A typo in a container or a RayCluster field is caught: the checks above would catch a real one."""
    typo = copy.deepcopy(rendered("cpu-default").one("Deployment"))
    typo["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        chart.validate(typo)
    cluster = copy.deepcopy(rendered("cpu-default").one("RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["minReplica"] = 1
    cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert check_raycluster(cluster) == [
        "spec.headGroupSpec.rayStartParams.num-cpus: 0 is not a string (map[string]string)",
        "spec.workerGroupSpecs[0].minReplica: not a field KubeRay documents",
    ]


# ---------------------------------------------------------------- checkpoints: one volume, every pod


@pytest.mark.parametrize("case", VOLUME_CASES)
def test_every_pod_mounts_the_same_checkpoint_claim_at_the_root_the_server_uses(case):
    r = rendered(case)
    values = merged_values(case)
    path = values["checkpoint"]["path"]
    claim = values["checkpoint"]["existingClaim"] or f"{r.release}-checkpoints"
    pods = r.pod_templates()
    expected_roles = {"control-plane"}
    if values["rayCluster"]["enabled"]:
        expected_roles |= {"ray-head"} | {
            f"worker/{name}" for name, group in values["rayCluster"]["workerGroups"].items() if group["enabled"]
        }
    assert set(pods) == expected_roles
    for role, template in pods.items():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        claims = [v for v in volumes.values() if v.get("persistentVolumeClaim", {}).get("claimName") == claim]
        assert len(claims) == 1, f"{role}: mounts the checkpoint claim {len(claims)} times"
        main = template["spec"]["containers"][0]
        mounts = [m for m in main["volumeMounts"] if m["name"] == claims[0]["name"]]
        assert [(m["mountPath"], m.get("readOnly", False)) for m in mounts] == [(path, False)], role
    # the claim is created ReadWriteMany, or is the operator's own
    created = [pvc for pvc in r.all("PersistentVolumeClaim") if pvc["metadata"]["name"] == claim]
    if values["checkpoint"]["existingClaim"]:
        assert created == []
    else:
        assert [pvc["spec"]["accessModes"] for pvc in created] == [["ReadWriteMany"]]
        assert created[0]["spec"]["resources"]["requests"]["storage"] == values["checkpoint"]["size"]
    settings = server_settings(case)
    assert str(settings.checkpoint_root("job-1")) == f"{path}/job-1"
    assert settings.checkpoint_tree == path


@pytest.mark.parametrize("case", S3_CASES)
def test_s3_checkpoints_mount_nothing_and_every_pod_gets_the_credentials(case):
    r = rendered(case)
    values = merged_values(case)
    url = values["checkpoint"]["path"]
    s3 = values["checkpoint"]["s3"]
    assert [pvc["metadata"]["name"] for pvc in r.all("PersistentVolumeClaim")] == [f"{r.release}-data"]
    secret = s3["existingSecret"] or f"{r.release}-s3"
    if s3["existingSecret"]:
        expected = dict(EXTERNAL_SECRETS[secret])
        assert r.secret_data(secret) is None
    else:
        expected = {
            "AWS_ACCESS_KEY_ID": s3["accessKeyId"],
            "AWS_SECRET_ACCESS_KEY": s3["secretAccessKey"],
            "AWS_ENDPOINT_URL": s3["endpointUrl"],
            "AWS_DEFAULT_REGION": s3["region"],
        }
        assert r.secret_data(secret) == {key: expected[key] for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    pods = r.pod_templates()
    assert set(pods) == {"control-plane", "ray-head", "worker/cpu"}
    for role, template in pods.items():
        claims = {v["name"] for v in template["spec"]["volumes"] if "persistentVolumeClaim" in v}
        assert claims - {"data", "token-cache"} == set(), f"{role} mounts a claim besides /data and the token cache"
        env = resolve_env(template["spec"]["containers"][0], r, EXTERNAL_SECRETS)
        assert {key: value for key, value in env.items() if key.startswith("AWS_")} == expected, role
    settings = server_settings(case)
    assert settings.checkpoint_root("job-1") == f"{url}/job-1"
    assert url in settings.storage_roots


@pytest.mark.parametrize("case", CASES)
def test_the_server_reads_its_data_dir_storage_roots_and_autoscaling_from_the_rendered_env(case):
    values = merged_values(case)
    settings = server_settings(case)
    assert settings.data_dir == Path("/data")
    shared = [volume["mountPath"] for volume in values["sharedVolumes"]]
    assert [str(root) for root in settings.storage_roots] == ["/data", values["checkpoint"]["path"], *shared]
    autoscaling = values["rayCluster"]["enabled"] and values["rayCluster"]["enableInTreeAutoscaling"]
    assert settings.admit_beyond_cluster is autoscaling
    args = control_plane(case)["args"]
    assert args[:4] == ["serve", "--host=0.0.0.0", "--port=8000", "--data-dir=/data"]
    ray_address = values["controlPlane"]["rayAddress"] or "ray://etrain-ray-head-svc.etrain.svc:10001"
    assert f"--ray-address={ray_address}" in args
    # every path the server writes is a mounted volume: the store on /data, scratch on /tmp
    mounts = {m["mountPath"]: m for m in control_plane(case)["volumeMounts"]}
    assert {"/data", "/tmp"} <= set(mounts)
    for root in shared:
        assert root in mounts


@pytest.mark.parametrize("case", ["cpu-default", "s3", "s3-token-cache"])
def test_the_token_cache_is_one_volume_every_pod_mounts_and_no_storage_root(case):
    """Ranks memory-map tokenized text from the folder the control plane wrote it to: the checkpoint volume by
    default, or `tokenCache.existingClaim` mounted at the same path in every pod (needed with s3:// checkpoints,
    where the default would be the control plane's /data). The server never counts it a storage root."""
    values = merged_values(case)
    settings = server_settings(case)
    claim = values["tokenCache"]["existingClaim"]
    assert settings.token_cache_max_gb == float(values["tokenCache"]["maxGB"])
    if not claim:
        expected = "/data/token-cache" if case == "s3" else f"{values['checkpoint']['path']}/.token-cache"
        assert settings.token_cache_dir == expected  # (the s3 case's: the control plane's alone, as values.yaml says)
        return
    assert settings.token_cache_dir == values["tokenCache"]["path"]
    assert all(not str(root).startswith(values["tokenCache"]["path"]) for root in settings.storage_roots)
    for role, template in rendered(case).pod_templates().items():
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == "token-cache")
        assert volume["persistentVolumeClaim"] == {"claimName": claim}, role
        mounts = [m for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] == "token-cache"]
        assert [(m["mountPath"], m.get("readOnly", False)) for m in mounts] == [(values["tokenCache"]["path"], False)]


def test_shared_volumes_are_mounted_at_the_same_path_in_every_pod():
    pods = rendered("everything").pod_templates()
    assert set(pods) == {"control-plane", "ray-head", "worker/cpu", "worker/gpu", "worker/big-cpu"}
    for role, template in pods.items():
        mounts = [
            (m["mountPath"], m.get("readOnly"))
            for m in template["spec"]["containers"][0]["volumeMounts"]
            if m["name"] == "datasets"
        ]
        assert mounts == [("/datasets", True)], role
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == "datasets")
        assert volume["persistentVolumeClaim"] == {"claimName": "datasets", "readOnly": True}


# ---------------------------------------------------------------- the API token and the routes


def _client(settings: Settings, tmp_path) -> TestClient:
    store = JobStore(tmp_path / "etrain.db")
    return TestClient(create_app(settings, manager=InMemoryManager(store)), raise_server_exceptions=False)


@pytest.mark.parametrize("case", ["cpu-default", "existing-secret"])
def test_the_token_secret_is_what_the_server_accepts(case, tmp_path):
    r = rendered(case)
    values = merged_values(case)
    secret = values["auth"]["existingSecret"] or r.release
    token = (r.secret_data(secret) or EXTERNAL_SECRETS.get(secret))[values["auth"]["secretKey"]]
    assert len(token) >= 32
    # the env var the server reads, from that Secret and key
    ref = next(var for var in control_plane(case)["env"] if var["name"] == "ETRAIN_API_TOKEN")
    assert ref["valueFrom"]["secretKeyRef"] == {"name": secret, "key": values["auth"]["secretKey"]}
    assert r.has("Secret", secret) is not bool(values["auth"]["existingSecret"])
    client = _client(server_settings(case, data_dir=tmp_path / "data"), tmp_path)
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    # NOTES.txt says where the token is, with a command that reads exactly this Secret and key
    assert (
        f"kubectl -n {r.namespace} get secret {secret} -o jsonpath='{{.data.{values['auth']['secretKey']}}}'"
        " | base64 -d" in r.notes
    )


def test_tenant_tokens_are_mounted_read_only_where_the_server_reads_them(tmp_path):
    r = rendered("existing-secret")
    pod = r.one("Deployment")["spec"]["template"]["spec"]
    env = resolve_env(pod["containers"][0], r, EXTERNAL_SECRETS)
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tenant-tokens")
    volume = next(v for v in pod["volumes"] if v["name"] == "tenant-tokens")
    assert mount["readOnly"] is True
    assert volume["secret"]["secretName"] == "etrain-tenants"
    items = {item["path"]: item["key"] for item in volume["secret"]["items"]}
    file_path = Path(env["ETRAIN_API_TOKENS_FILE"])
    assert file_path.parent == Path(mount["mountPath"]) and items == {file_path.name: "api-tokens"}
    # the server, given that file, accepts the tenants' tokens
    tokens_file = tmp_path / file_path.name
    tokens_file.write_text(EXTERNAL_SECRETS["etrain-tenants"]["api-tokens"])
    env["ETRAIN_API_TOKENS_FILE"] = str(tokens_file)
    client = _client(Settings.from_env(env, data_dir=tmp_path / "data"), tmp_path)
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer Alice-token-0123456789"}).status_code == 200
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer nobody-0123456789"}).status_code == 401


def test_without_auth_secret_the_server_generates_its_token_onto_the_data_volume():
    r = rendered("generated-token")
    assert not r.has("Secret")
    settings = server_settings("generated-token")
    assert settings.api_token is None and settings.api_token_path == Path("/data/api-token")
    volume = next(v for v in r.one("Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == "data")
    assert volume["persistentVolumeClaim"]["claimName"] == f"{r.release}-data"
    assert f"kubectl -n {r.namespace} exec deploy/{r.release} -- cat /data/api-token" in r.notes


def test_probes_hit_routes_the_app_answers_without_a_token(tmp_path):
    container = control_plane("cpu-default")
    probes = {name: container[name] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    client = _client(server_settings("cpu-default", data_dir=tmp_path / "data"), tmp_path)
    routes = set(client.app.openapi()["paths"])
    for name, probe in probes.items():
        get = probe["httpGet"]
        assert get["port"] in ports and ports[get["port"]] == 8000, name
        assert get["path"] in routes, f"{name}: {get['path']} is not a route of the app"
        # the kubelet sends no token: the route must answer 200 without one
        assert client.get(get["path"]).status_code == 200, name


# ---------------------------------------------------------------- GPUs


@pytest.mark.parametrize("gpus", [1, 4, 8])
def test_gpu_groups_request_the_gpus_the_values_ask(gpus):
    r = render({"rayCluster": {"workerGroups": {"gpu": {"enabled": True, "gpus": gpus}}}})
    groups = {g["groupName"]: g for g in r.one("RayCluster")["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}
    resources = groups["gpu"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == gpus and resources["requests"]["nvidia.com/gpu"] == gpus
    assert resources["limits"]["cpu"] == "8" and resources["limits"]["memory"] == "128Gi"
    assert "nvidia.com/gpu" not in groups["cpu"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    tolerations = groups["gpu"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_the_gpu_matrix_entries_give_each_group_its_count():
    groups = {g["groupName"]: g for g in rendered("everything").one("RayCluster")["spec"]["workerGroupSpecs"]}
    gpus = {
        name: g["template"]["spec"]["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu")
        for name, g in groups.items()
    }
    assert gpus == {"big-cpu": None, "cpu": None, "gpu": 8}
    assert [g["replicas"] for g in rendered("everything").one("RayCluster")["spec"]["workerGroupSpecs"]] == [1, 1, 2]


# ---------------------------------------------------------------- autoscaling


def test_autoscaling_on_runs_the_sidecar_hardened_and_lets_the_server_queue_for_it():
    spec = rendered("cpu-default").one("RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert options["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "HOME", "value": "/tmp"} in options["env"]
    assert {"name": "tmp", "mountPath": "/tmp"} in options["volumeMounts"]
    # only the head (its autoscaler sidecar) keeps a service-account token
    assert "automountServiceAccountToken" not in spec["headGroupSpec"]["template"]["spec"]
    assert all(g["template"]["spec"]["automountServiceAccountToken"] is False for g in spec["workerGroupSpecs"])


def test_autoscaling_off_runs_the_replicas_asked_and_no_sidecar():
    spec = rendered("autoscaling-off").one("RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in spec
    assert [(g["groupName"], g["replicas"]) for g in spec["workerGroupSpecs"]] == [("cpu", 3)]
    assert spec["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "ETRAIN_ADMIT_BEYOND_CLUSTER" not in {var["name"] for var in control_plane("autoscaling-off")["env"]}


# ---------------------------------------------------------------- least privilege


@pytest.mark.parametrize("case", CASES)
def test_no_container_runs_as_root_or_with_a_writable_root_filesystem(case):
    r = rendered(case)
    for role, template in r.pod_templates().items():
        pod = template["spec"].get("securityContext", {})
        if role != "ray-head":  # the head keeps a token only for the autoscaler sidecar (test above)
            assert template["spec"]["automountServiceAccountToken"] is False, role
        for container in containers(template):
            context = {**pod, **container.get("securityContext", {})}
            where = f"{role}/{container['name']}"
            assert context.get("runAsNonRoot") is True, where
            assert context.get("runAsUser", 0) != 0 and context.get("runAsGroup", 0) != 0, where
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            assert context.get("readOnlyRootFilesystem") is True, where
            assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, where
            # what it must write is a volume: /tmp (HOME, Ray's session dir) and, for Ray, /dev/shm
            writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
            assert "/tmp" in writable, where
            assert {"name": "HOME", "value": "/tmp"} in container["env"], where
            if role != "control-plane":
                assert "/dev/shm" in writable, where
    options = r.all("RayCluster")[0]["spec"].get("autoscalerOptions") if r.has("RayCluster") else None
    if options:
        assert options["securityContext"]["readOnlyRootFilesystem"] is True
        assert options["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_pod_user_is_the_images_user():
    """The images run as uid 1000 gid 100 (Ray's base-image user); the pods ask for exactly that."""
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        users = re.findall(r"^USER\s+(\S+)", (ROOT / "deploy" / dockerfile).read_text(), re.M)
        assert users and users[-1] == "1000:100", f"deploy/{dockerfile} ends as USER {users[-1:]}"
    for role, template in rendered("everything").pod_templates().items():
        context = template["spec"]["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (1000, 100, 100), role


@pytest.mark.parametrize("case", CASES)
def test_network_policies_let_only_the_api_and_ray_pods_reach_ray(case):
    r = rendered(case)
    values = merged_values(case)
    policies = {p["metadata"]["name"]: p["spec"] for p in r.all("NetworkPolicy")}
    pods = r.pod_templates()
    cp_labels = pods["control-plane"]["metadata"]["labels"]
    api = policies.pop(f"{r.release}-api")
    assert labels_match(api["podSelector"]["matchLabels"], cp_labels)
    assert api["policyTypes"] == ["Ingress"]
    assert [rule["ports"] for rule in api["ingress"]] == [[{"port": "http", "protocol": "TCP"}]]
    if not values["rayCluster"]["enabled"]:
        assert policies == {}
        return
    ray = policies.pop(f"{r.release}-ray")
    assert policies == {}
    selector = ray["podSelector"]["matchLabels"]
    for role, template in pods.items():
        assert labels_match(selector, template["metadata"]["labels"]) is (role != "control-plane"), role
    assert ray["policyTypes"] == ["Ingress"]
    from_ray, from_api, *rest = ray["ingress"]
    assert "ports" not in from_ray and [
        labels_match(peer["podSelector"]["matchLabels"], pods["ray-head"]["metadata"]["labels"])
        for peer in from_ray["from"]
    ] == [True]
    assert [labels_match(peer["podSelector"]["matchLabels"], cp_labels) for peer in from_api["from"]] == [True]
    assert sorted(port["port"] for port in from_api["ports"]) == [6379, 8265, 10001]
    if values["monitoring"]["podMonitor"]["enabled"]:
        assert rest == [{"ports": [{"port": 8080, "protocol": "TCP"}], "from": [{"namespaceSelector": {}}]}]
    else:
        assert rest == []


def test_network_policies_can_be_turned_off():
    assert not render({"networkPolicy": {"enabled": False}}).has("NetworkPolicy")


# ---------------------------------------------------------------- exposure: ingress and monitoring


@pytest.mark.parametrize("case", CASES)
def test_ingress_routes_its_host_to_the_api_service_over_tls(case):
    r = rendered(case)
    values = merged_values(case)["ingress"]
    if not values["enabled"]:
        assert not r.has("Ingress")
        return
    ingress = r.one("Ingress")["spec"]
    service = r.one("Service")
    [rule] = ingress["rules"]
    [path] = rule["http"]["paths"]
    assert rule["host"] == values["host"] and path["path"] == "/" and path["pathType"] == "Prefix"
    assert path["backend"]["service"] == {"name": service["metadata"]["name"], "port": {"name": "http"}}
    assert "http" in {port["name"] for port in service["spec"]["ports"]}
    if values["tls"]["enabled"]:
        assert ingress["tls"] == [{"hosts": [values["host"]], "secretName": f"{r.release}-tls"}]
        assert f"https://{values['host']}" in r.notes
    else:
        assert "tls" not in ingress
    assert ingress.get("ingressClassName") == (values["className"] or None)


@pytest.mark.parametrize("case", CASES)
def test_monitors_select_the_api_service_and_every_ray_pod(case):
    r = rendered(case)
    values = merged_values(case)["monitoring"]
    if values["serviceMonitor"]["enabled"]:
        monitor = r.one("ServiceMonitor")
        service = r.one("Service")
        assert labels_match(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        [endpoint] = monitor["spec"]["endpoints"]
        assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
        assert labels_match(values["serviceMonitor"]["labels"], monitor["metadata"]["labels"])
        if values["serviceMonitor"]["scrapeWithToken"]:
            assert endpoint["authorization"] == {
                "type": "Bearer",
                "credentials": {"name": r.release, "key": "api-token"},
            }
            assert r.secret_data(r.release)["api-token"]
        else:
            assert "authorization" not in endpoint
    else:
        assert not r.has("ServiceMonitor")
    if values["podMonitor"]["enabled"]:
        monitor = r.one("PodMonitor")
        assert monitor["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": r.one("RayCluster")["metadata"]["name"]}
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        for role, template in r.pod_templates().items():
            if role != "control-plane":
                ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
                assert ports[endpoint["port"]] == 8080, role
    else:
        assert not r.has("PodMonitor")


def test_notes_say_how_to_reach_the_api_and_the_dashboard():
    r = rendered("cpu-default")
    service = r.one("Service")["metadata"]["name"]
    head_service = f"{r.one('RayCluster')['metadata']['name']}-head-svc"
    assert f"kubectl -n etrain port-forward svc/{service} 8000:8000" in r.notes
    assert f"kubectl -n etrain port-forward svc/{head_service} 8265:8265" in r.notes
    assert "/checkpoints/<job id> on claim etrain-checkpoints" in r.notes


# ---------------------------------------------------------------- values refused, with the fix


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        # the deployment guide's old GPU key and the old checkpoint section no longer exist
        ({"rayCluster": {"gpuWorkers": {"enabled": True}}}, helm.HelmValuesError, "gpuWorkers"),
        ({"checkpoints": {"existingClaim": "x"}}, helm.HelmValuesError, "checkpoints"),
        ({"controlPlane": {"replicas": 2}}, helm.HelmValuesError, "replicas"),  # SQLite: one control plane
        ({"checkpoint": {"path": "checkpoints"}}, helm.HelmValuesError, "/checkpoint/path"),
        ({"checkpoint": {"path": "/data/checkpoints"}}, helm.HelmValuesError, "/checkpoint/path"),
        ({"checkpoint": {"path": "/a:b"}}, helm.HelmValuesError, "/checkpoint/path"),
        ({"checkpoint": {"path": "s3://Bad_Bucket/x"}}, helm.HelmValuesError, "/checkpoint/path"),
        ({"tokenCache": {"path": "/data/tokens"}}, helm.HelmValuesError, "/tokenCache/path"),
        ({"tokenCache": {"maxGB": "lots"}}, helm.HelmValuesError, "/tokenCache/maxGB"),
        (
            {"tokenCache": {"existingClaim": "t", "path": "/checkpoints"}},
            helm.HelmRenderError,
            "tokenCache.path /checkpoints is already used",
        ),
        ({"rayCluster": {"workerGroups": {"gpu": {"gpus": -1}}}}, helm.HelmValuesError, "gpus"),
        ({"checkpoint": {"path": "s3://bucket/x"}}, helm.HelmRenderError, "checkpoint.s3.existingSecret"),
        (
            {"checkpoint": {"path": "s3://bucket/x", "existingClaim": "nfs", "s3": {"existingSecret": "s"}}},
            helm.HelmRenderError,
            "checkpoint.existingClaim is set",
        ),
        (
            {"rayCluster": {"workerGroups": {"cpu": {"minReplicas": 3, "maxReplicas": 2}}}},
            helm.HelmRenderError,
            "minReplicas 3 is above maxReplicas 2",
        ),
        (
            {"rayCluster": {"enableInTreeAutoscaling": False, "workerGroups": {"cpu": {"replicas": 9}}}},
            helm.HelmRenderError,
            "replicas 9 must lie between minReplicas 1 and maxReplicas 4",
        ),
        ({"ingress": {"enabled": True}}, helm.HelmRenderError, "ingress.host is empty"),
        (
            {"sharedVolumes": [{"name": "d", "mountPath": "/checkpoints", "volume": {"emptyDir": {}}}]},
            helm.HelmRenderError,
            "mountPath /checkpoints is already used",
        ),
        ({"rayCluster": {"enabled": False}}, helm.HelmRenderError, "controlPlane.rayAddress is required"),
        (
            {"auth": {"enabled": False}, "monitoring": {"serviceMonitor": {"enabled": True, "scrapeWithToken": True}}},
            helm.HelmRenderError,
            "scrapeWithToken needs the token Secret",
        ),
    ],
)
def test_bad_values_are_refused_with_the_field_named(values, error, message):
    with pytest.raises(error, match=re.escape(message)):
        render(values)


# ---------------------------------------------------------------- values.yaml itself

#: Maps handed to Kubernetes verbatim: documented as a whole, their inner keys are not chart values.
PASSTHROUGH = {
    "resources",
    "podSecurityContext",
    "securityContext",
    "startupProbe",
    "readinessProbe",
    "livenessProbe",
    "rayStartParams",
    "nodeSelector",
    "affinity",
    "annotations",
    "labels",
    "podAnnotations",
    "podLabels",
    "commonLabels",
    "autoscalerOptions",
    "gcsFaultToleranceOptions",
}


def test_every_value_is_preceded_by_a_doc_comment():
    text = (chart.CHART / "values.yaml").read_text()
    lines = text.splitlines()
    undocumented: list[str] = []

    def documented(line_no: int) -> bool:
        i = line_no - 1
        while i >= 0 and lines[i].lstrip().startswith("#"):
            if lines[i].lstrip().startswith("# --"):
                return True
            i -= 1
        return False

    def walk(node: yaml.MappingNode, prefix: str) -> None:
        for key_node, value_node in node.value:
            path = f"{prefix}{key_node.value}"
            if not documented(key_node.start_mark.line):
                undocumented.append(f"{path} (line {key_node.start_mark.line + 1})")
            if isinstance(value_node, yaml.MappingNode) and key_node.value not in PASSTHROUGH:
                walk(value_node, path + ".")

    walk(yaml.compose(text), "")
    assert not undocumented, "values without a `# --` comment right above them: " + ", ".join(undocumented)


def test_chart_metadata_and_ray_version_match_the_project():
    with helm.Chart.load(chart.CHART) as loaded:
        metadata = loaded.metadata
        defaults = loaded.values
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert (metadata["name"], metadata["type"], metadata["appVersion"]) == ("etrain", "application", project["version"])
    ray_pin = next(dep for dep in project["dependencies"] if dep.startswith("ray["))
    assert ray_pin.endswith(f"=={defaults['rayCluster']['rayVersion']}")
    assert defaults["checkpoint"]["path"] == "/checkpoints" and defaults["checkpoint"]["existingClaim"] == ""
