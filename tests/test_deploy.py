"""Structure checks for the deployment files: no cluster, no Docker daemon, no systemd.

What is checked against the real code rather than against copies of it:
- the ConfigMap's TOML (and the sample for systemd) go through ``rmqfast.config`` validation,
  with each workload's command-line flags applied through ``rmqfast.cli``'s own parser;
- the probe and HEALTHCHECK paths are asked of a real supervisor admin endpoint;
- the dashboard's metric names are compared with what ``rmqfast.metrics.Metrics()`` registers;
- the unit file goes through ``systemd-analyze verify`` when it is installed.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rmqfast import cli
from rmqfast import config as config_mod
from rmqfast.config import Config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
UNIT = DEPLOY / "systemd" / "rmqfast.service"
UNIT_TOML = DEPLOY / "systemd" / "rmqfast.toml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DASHBOARD = DEPLOY / "grafana" / "rmqfast-dashboard.json"
SCRAPE = DEPLOY / "prometheus" / "scrape.yml"

# Measured footprint: a worker's RSS is 33-51 MiB, the supervisor's about 30 MiB.
WORKER_RSS_MIB = 51
SUPERVISOR_RSS_MIB = 30

API_VERSIONS = {
    "ConfigMap": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "StatefulSet": "apps/v1",
    "PodDisruptionBudget": "policy/v1",
}


# --------------------------------------------------------------------------------------------
# Kubernetes


@dataclass
class Doc:
    file: str
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body.get("kind"))

    @property
    def name(self) -> str:
        return str(self.body.get("metadata", {}).get("name"))

    def where(self) -> str:
        return f"deploy/k8s/{self.file}: {self.kind}/{self.name}"


def k8s_docs() -> list[Doc]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for body in yaml.safe_load_all(path.read_text()):
            if body is not None:
                assert isinstance(body, dict), f"deploy/k8s/{path.name}: a document is not a mapping"
                docs.append(Doc(path.name, body))
    return docs


def of_kind(kind: str) -> list[Doc]:
    return [d for d in k8s_docs() if d.kind == kind]


def one(kind: str) -> Doc:
    found = of_kind(kind)
    assert len(found) == 1, f"deploy/k8s: expected exactly one {kind}, found {[d.where() for d in found]}"
    return found[0]


def workloads() -> list[Doc]:
    return of_kind("Deployment") + of_kind("StatefulSet")


def container(doc: Doc) -> dict[str, Any]:
    cs = doc.body["spec"]["template"]["spec"]["containers"]
    assert len(cs) == 1, f"{doc.where()}: expected one container (rmqfast), found {len(cs)}"
    return cs[0]


def container_ports(doc: Doc) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(doc).get("ports", [])}


def config_toml() -> tuple[str, str]:
    """(key, TOML text) of the ConfigMap."""
    cm = one("ConfigMap")
    data = cm.body.get("data", {})
    tomls = {k: v for k, v in data.items() if k.endswith(".toml")}
    assert len(tomls) == 1, f"{cm.where()}: expected one *.toml key in data, found {sorted(data)}"
    return next(iter(tomls.items()))


def effective_config(doc: Doc) -> Config:
    """The configuration the pod's rmqfast would run: ConfigMap TOML + the container's flags."""
    c = container(doc)
    argv = list(c.get("command", [])[1:]) + list(c.get("args", []))
    args = cli.build_parser().parse_args(argv)
    assert args.command == "serve", f"{doc.where()}: the container must run `rmqfast serve`, runs {argv}"
    key, text = config_toml()
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    vols = {v["name"]: v for v in doc.body["spec"]["template"]["spec"].get("volumes", [])}
    cm_mounts = [mounts[n] for n, v in vols.items() if "configMap" in v and n in mounts]
    assert args.config in [f"{m.rstrip('/')}/{key}" for m in cm_mounts], (
        f"{doc.where()}: --config {args.config} is not the ConfigMap key {key!r} under any ConfigMap "
        f"mount ({cm_mounts}); mount the ConfigMap and point --config at the file"
    )
    return config_mod.from_dict(config_mod.apply_overrides(tomllib.loads(text), cli._overrides(args)))


def selected_workloads(selector: dict[str, str]) -> list[Doc]:
    return [w for w in workloads() if selector.items() <= w.body["spec"]["template"]["metadata"]["labels"].items()]


def mebibytes(q: str | int) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "K": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    s = str(q)
    for u, f in units.items():
        if s.endswith(u):
            return float(s[: -len(u)]) * f
    return float(s) / 2**20


def cores(q: str | int) -> float:
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def test_k8s_kinds_and_api_versions() -> None:
    docs = k8s_docs()
    assert docs, "deploy/k8s holds no manifests"
    for d in docs:
        assert d.kind in API_VERSIONS, f"{d.where()}: unexpected kind; expected one of {sorted(API_VERSIONS)}"
        assert d.body.get("apiVersion") == API_VERSIONS[d.kind], (
            f"{d.where()}: apiVersion {d.body.get('apiVersion')!r}; expected {API_VERSIONS[d.kind]!r}"
        )
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d.name), f"{d.where()}: not a valid DNS-1123 name"
    kinds = sorted(d.kind for d in docs)
    for needed in ("ConfigMap", "Deployment", "StatefulSet", "PodDisruptionBudget"):
        assert needed in kinds, f"deploy/k8s: no {needed}; found {kinds}"
    assert kinds.count("Service") >= 2, "deploy/k8s: expected a Service per tier (name server, headless broker)"
    names = [(d.kind, d.name) for d in docs]
    assert len(names) == len(set(names)), f"deploy/k8s: duplicate kind/name pairs in {names}"


def test_kustomization_lists_every_manifest() -> None:
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == files, (
        f"deploy/k8s/kustomization.yaml: resources {sorted(k['resources'])} differ from the manifests {sorted(files)}"
    )
    images = {i["name"] for i in k.get("images", [])}
    for w in workloads():
        assert container(w)["image"].split(":")[0] in images, f"{w.where()}: image not managed by kustomization"


def test_kubectl_kustomize_builds() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; kustomization checked structurally only")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize deploy/k8s failed:\n{out.stderr}"
    built = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout) if d)
    assert built == sorted((d.kind, d.name) for d in k8s_docs())


def test_workload_selectors_match_template_labels() -> None:
    deploy, sts = one("Deployment"), one("StatefulSet")
    assert deploy.body["spec"]["replicas"] >= 2, f"{deploy.where()}: the name-server tier needs >= 2 replicas"
    for w in (deploy, sts):
        sel = w.body["spec"]["selector"]["matchLabels"]
        labels = w.body["spec"]["template"]["metadata"]["labels"]
        assert sel and sel.items() <= labels.items(), (
            f"{w.where()}: selector {sel} does not match the pod template labels {labels}"
        )
    # The two tiers must not select each other's pods.
    assert len(selected_workloads(deploy.body["spec"]["selector"]["matchLabels"])) == 1
    assert len(selected_workloads(sts.body["spec"]["selector"]["matchLabels"])) == 1


def test_services_select_one_workload_and_its_ports() -> None:
    for svc in of_kind("Service"):
        sel = svc.body["spec"].get("selector", {})
        targets = selected_workloads(sel)
        assert len(targets) == 1, f"{svc.where()}: selector {sel} selects {[t.where() for t in targets]}"
        ports = container_ports(targets[0])
        for p in svc.body["spec"]["ports"]:
            tp = p.get("targetPort", p["port"])
            assert tp in ports or tp in ports.values(), (
                f"{svc.where()}: targetPort {tp!r} is no container port of {targets[0].where()} ({ports})"
            )
    sts = one("StatefulSet")
    headless = [s for s in of_kind("Service") if s.name == sts.body["spec"]["serviceName"]]
    assert headless, f"{sts.where()}: serviceName {sts.body['spec']['serviceName']!r} names no Service"
    assert headless[0].body["spec"].get("clusterIP") == "None", f"{headless[0].where()}: must be headless"
    assert selected_workloads(headless[0].body["spec"]["selector"]) == [sts]


def test_configmap_toml_passes_rmqfast_validation() -> None:
    for w in workloads():
        cfg = effective_config(w)  # raises ConfigError naming the key if the TOML is invalid
        assert cfg.proxy.workers == 2, (
            f"{w.where()}: proxy.workers = {cfg.proxy.workers}; set it explicitly (the resources are sized for "
            "2 workers; 0 would follow the pod's CPU limit instead)"
        )
        assert cfg.admin.listen is not None and cfg.admin.listen.is_wildcard, (
            f"{w.where()}: admin.listen {cfg.admin.listen} must bind 0.0.0.0 so the kubelet can probe it"
        )
        assert Path(cfg.proxy.state_dir).is_absolute(), f"{w.where()}: proxy.state_dir must be absolute"


def test_configmap_validation_rejects_a_bad_toml() -> None:
    """The validation used above does refuse bad input (so the test above can fail)."""
    _, text = config_toml()
    bad = text.replace("workers = 2", "workers = -1")
    assert bad != text
    with pytest.raises(config_mod.ConfigError, match="proxy.workers"):
        config_mod.from_dict(tomllib.loads(bad))


def test_tier_ports_match_the_config() -> None:
    deploy, sts = one("Deployment"), one("StatefulSet")
    dcfg = effective_config(deploy)
    assert dcfg.namesrv.listen is not None and dcfg.namesrv.listen.is_wildcard
    assert container_ports(deploy).get("namesrv") == dcfg.namesrv.listen.port, (
        f"{deploy.where()}: container port 'namesrv' must be namesrv.listen's port {dcfg.namesrv.listen.port}"
    )
    scfg = effective_config(sts)
    assert scfg.brokers.static, "ConfigMap: the broker tier needs static broker endpoints (brokers.static)"
    assert scfg.brokers.port_range is None, (
        "ConfigMap: brokers.port_range must be '' (pods cannot share an allocated endpoint table)"
    )
    wanted = {s.listen.port for s in scfg.brokers.static}
    if scfg.brokers.vip_channel:
        wanted |= {p - 2 for p in wanted}
    have = set(container_ports(sts).values())
    assert wanted <= have, f"{sts.where()}: broker endpoint ports {sorted(wanted - have)} are not container ports"
    headless = next(s for s in of_kind("Service") if s.name == sts.body["spec"]["serviceName"])
    svc_ports = {p["port"] for p in headless.body["spec"]["ports"]}
    assert wanted <= svc_ports, f"{headless.where()}: broker endpoint ports {sorted(wanted - svc_ports)} missing"
    assert scfg.advertise_host == headless.name or scfg.advertise_host.startswith(headless.name + "."), (
        f"ConfigMap: proxy.advertise_host {scfg.advertise_host!r} should name the headless Service "
        f"{headless.name!r} so rewritten routes reach the broker tier"
    )


def test_probes_use_admin_port_and_served_paths(admin_paths: dict[str, int]) -> None:
    for w in workloads():
        cfg = effective_config(w)
        assert cfg.admin.listen is not None
        c = container(w)
        ports = container_ports(w)
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            get = c.get(probe, {}).get("httpGet")
            assert get, f"{w.where()}: no {probe}.httpGet"
            assert get["path"] == path, f"{w.where()}: {probe} path {get['path']!r}; expected {path!r}"
            port = ports.get(get["port"], get["port"])
            assert port == cfg.admin.listen.port, (
                f"{w.where()}: {probe} port {get['port']!r} is not admin.listen's port {cfg.admin.listen.port}"
            )
            assert admin_paths[get["path"]] != 404, f"the supervisor does not serve {get['path']}"


def test_statefulset_claims_the_state_dir() -> None:
    sts = one("StatefulSet")
    cfg = effective_config(sts)
    claims = {t["metadata"]["name"]: t for t in sts.body["spec"].get("volumeClaimTemplates", [])}
    assert claims, f"{sts.where()}: no volumeClaimTemplates (the spill needs a persistent volume)"
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container(sts).get("volumeMounts", [])}
    name = mounts.get(cfg.proxy.state_dir.rstrip("/"))
    assert name in claims, (
        f"{sts.where()}: proxy.state_dir {cfg.proxy.state_dir} is not mounted from a volumeClaimTemplate "
        f"(mounts {mounts}, claims {sorted(claims)})"
    )
    spec = claims[name]["spec"]
    assert "ReadWriteOnce" in spec["accessModes"] and spec["resources"]["requests"]["storage"]


def test_writable_paths_under_a_read_only_root() -> None:
    for w in workloads():
        c = container(w)
        if not c.get("securityContext", {}).get("readOnlyRootFilesystem"):
            continue
        mounts = {m["mountPath"].rstrip("/") for m in c.get("volumeMounts", []) if not m.get("readOnly")}
        tmpdir = {e["name"]: e.get("value") for e in c.get("env", [])}.get("TMPDIR", "/tmp")
        # The supervisor creates PROMETHEUS_MULTIPROC_DIR with tempfile.mkdtemp(), under $TMPDIR.
        assert tmpdir in mounts, f"{w.where()}: read-only root but {tmpdir} ($TMPDIR) is not a writable mount"
        assert effective_config(w).proxy.state_dir.rstrip("/") in mounts, f"{w.where()}: state_dir not writable"


def test_resources_match_the_measured_footprint() -> None:
    for w in workloads():
        cfg = effective_config(w)
        res = container(w).get("resources", {})
        for part in ("requests", "limits"):
            for r in ("cpu", "memory"):
                assert r in res.get(part, {}), f"{w.where()}: resources.{part}.{r} is missing"
        need = cfg.proxy.workers * WORKER_RSS_MIB + SUPERVISOR_RSS_MIB
        req, lim = mebibytes(res["requests"]["memory"]), mebibytes(res["limits"]["memory"])
        assert req >= need, f"{w.where()}: memory request {req:.0f} MiB < measured footprint {need} MiB"
        assert lim >= req * 1.5, f"{w.where()}: memory limit {lim:.0f} MiB leaves no room over the request"
        assert cores(res["limits"]["cpu"]) >= cfg.proxy.workers, (
            f"{w.where()}: a CPU limit below the worker count ({cfg.proxy.workers}) throttles the event loops"
        )
        grace = w.body["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        assert grace > cfg.proxy.drain_timeout + 5, (
            f"{w.where()}: terminationGracePeriodSeconds {grace} must exceed drain_timeout + 5 "
            f"({cfg.proxy.drain_timeout + 5}), the supervisor's stop budget"
        )


def test_pods_run_as_the_image_user() -> None:
    uid = re.search(r"^ARG RMQFAST_UID=(\d+)", DOCKERFILE.read_text(), re.M)
    assert uid, "Dockerfile: no ARG RMQFAST_UID"
    for w in workloads():
        sc = w.body["spec"]["template"]["spec"].get("securityContext", {})
        assert sc.get("runAsNonRoot") is True, f"{w.where()}: runAsNonRoot must be true"
        assert sc.get("runAsUser") == int(uid.group(1)), f"{w.where()}: runAsUser differs from the image's user"
        csc = container(w).get("securityContext", {})
        assert csc.get("allowPrivilegeEscalation") is False and csc.get("capabilities", {}).get("drop") == ["ALL"]


def test_pdbs_cover_each_tier() -> None:
    pdbs = of_kind("PodDisruptionBudget")
    covered = []
    for pdb in pdbs:
        spec = pdb.body["spec"]
        assert ("minAvailable" in spec) != ("maxUnavailable" in spec), f"{pdb.where()}: set one of min/max"
        targets = selected_workloads(spec["selector"]["matchLabels"])
        assert len(targets) == 1, f"{pdb.where()}: selector selects {[t.where() for t in targets]}"
        covered.append(targets[0].name)
    assert sorted(covered) == sorted(w.name for w in workloads()), f"PDBs cover {covered}, not every workload"


# --------------------------------------------------------------------------------------------
# The admin endpoint the probes and the HEALTHCHECK ask


class _AliveProc:
    """Stands in for a worker's Popen in the supervisor's table: alive, with a pid."""

    pid = 4242

    def poll(self) -> int | None:
        return None


@pytest.fixture(scope="module")
def admin_url() -> Iterator[str]:
    """A real supervisor admin endpoint on a free loopback port, with one (stand-in) live worker."""
    from rmqfast.server.supervisor import Supervisor, WorkerProc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config_mod.from_dict({"namesrv": {"upstreams": ["127.0.0.1:1"]},
                                "admin": {"listen": f"127.0.0.1:{port}"}})
    sup = Supervisor(cfg, lambda: cfg)
    sup._start_admin()
    sup.state.workers[0] = WorkerProc(0, _AliveProc(), -1, 0.0)  # type: ignore[arg-type]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        assert sup.admin is not None
        sup.admin.shutdown()
        sup.admin.server_close()
        shutil.rmtree(sup.runtime, ignore_errors=True)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def admin_paths(admin_url: str) -> dict[str, int]:
    return {p: _status(admin_url + p) for p in ("/healthz", "/readyz", "/metrics", "/no-such-path")}


def test_admin_endpoint_serves_the_probe_paths(admin_paths: dict[str, int]) -> None:
    assert admin_paths["/healthz"] == 200
    assert admin_paths["/readyz"] in (200, 503)  # 503 here: the stand-in worker never said ready
    assert admin_paths["/metrics"] == 200
    assert admin_paths["/no-such-path"] == 404  # so "!= 404" above tells served paths apart


# --------------------------------------------------------------------------------------------
# Dockerfile and .dockerignore


def dockerfile_stages() -> list[dict[str, Any]]:
    """[{from, name, lines: [(INSTRUCTION, args)]}], continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[dict[str, Any]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, args = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args.strip(), re.I)
            assert m, f"Dockerfile: cannot read FROM {args!r}"
            stages.append({"from": m.group(1), "name": m.group(2), "lines": []})
        elif stages:
            stages[-1]["lines"].append((instr, args.strip()))
    return stages


def test_dockerfile_is_multi_stage_and_non_root() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2, "Dockerfile: expected a builder stage and a runtime stage"
    builder, runtime = stages[0], stages[-1]
    assert builder["name"], "Dockerfile: name the first stage (FROM ... AS builder)"
    assert any(i == "RUN" and "pip wheel" in a for i, a in builder["lines"]), "builder stage builds no wheel"
    assert any(i == "COPY" and f"--from={builder['name']}" in a for i, a in runtime["lines"]), (
        "Dockerfile: the runtime stage copies nothing from the builder stage"
    )
    assert not any(i == "RUN" and re.search(r"\b(gcc|build-essential|cython)\b", a, re.I)
                   for i, a in runtime["lines"]), "Dockerfile: the runtime stage installs build tools"
    users = [a for i, a in runtime["lines"] if i == "USER"]
    assert users, "Dockerfile: the runtime stage has no USER (it would run as root)"
    assert users[-1].split(":")[0] not in ("root", "0"), f"Dockerfile: USER {users[-1]} is root"


def test_dockerfile_volumes_ports_entrypoint() -> None:
    runtime = dockerfile_stages()[-1]
    lines = runtime["lines"]
    volumes = set(json.loads(next(a for i, a in lines if i == "VOLUME")))
    assert {"/etc/rmqfast", "/var/lib/rmqfast"} <= volumes, f"Dockerfile: VOLUME {volumes}"
    exposed = " ".join(a for i, a in lines if i == "EXPOSE").split()
    for port in ("9876", "9400"):
        assert port in exposed, f"Dockerfile: EXPOSE {exposed} lacks {port}"
    cmd = json.loads(next(a for i, a in lines if i == "ENTRYPOINT")) + json.loads(next(a for i, a in lines
                                                                                      if i == "CMD"))
    assert cmd[0] == "rmqfast", f"Dockerfile: ENTRYPOINT {cmd} does not run rmqfast"
    args = cli.build_parser().parse_args(cmd[1:])
    assert args.command == "serve" and args.config and args.config.startswith("/etc/rmqfast/")


def test_dockerfile_healthcheck_asks_healthz(admin_url: str) -> None:
    runtime = dockerfile_stages()[-1]
    hc = [a for i, a in runtime["lines"] if i == "HEALTHCHECK"]
    assert len(hc) == 1, "Dockerfile: the runtime stage needs one HEALTHCHECK"
    m = re.search(r"CMD\s+(\[.*\])\s*$", hc[0])
    assert m, f"Dockerfile: HEALTHCHECK {hc[0]!r} is not in exec form"
    argv = json.loads(m.group(1))
    assert "curl" not in argv[0] and "wget" not in argv[0], "the slim image has no curl/wget"
    envs = " ".join(a for i, a in runtime["lines"] if i == "ENV")
    url = re.search(r"RMQFAST_HEALTH_URL=(\S+)", envs)
    assert url and url.group(1).endswith("/healthz"), f"Dockerfile: RMQFAST_HEALTH_URL {url} must end in /healthz"
    exposed = " ".join(a for i, a in runtime["lines"] if i == "EXPOSE").split()
    assert url.group(1).split(":")[-1].split("/")[0] in exposed, "the health URL's port is not EXPOSEd"
    # Run the very command against a real admin endpoint: healthy -> 0, unknown path -> not 0.
    argv[0] = sys.executable if argv[0] in ("python", "python3") else argv[0]
    ok = subprocess.run(argv, env={"RMQFAST_HEALTH_URL": admin_url + "/healthz"}, capture_output=True, timeout=30)
    assert ok.returncode == 0, f"HEALTHCHECK failed against a healthy endpoint: {ok.stderr.decode()}"
    bad = subprocess.run(argv, env={"RMQFAST_HEALTH_URL": admin_url + "/nope"}, capture_output=True, timeout=30)
    assert bad.returncode != 0, "HEALTHCHECK passes against a 404: it checks nothing"


def test_dockerfile_healthcheck_runs_no_module_of_its_working_directory(admin_url: str, tmp_path: Path) -> None:
    """The HEALTHCHECK runs in WORKDIR, the state directory: a module planted there must not run
    (issue 30, finding 8: `python -c` puts the working directory first on sys.path)."""
    runtime = dockerfile_stages()[-1]
    hc = next(a for i, a in runtime["lines"] if i == "HEALTHCHECK")
    argv = json.loads(re.search(r"CMD\s+(\[.*\])\s*$", hc).group(1))  # type: ignore[union-attr]
    assert argv[0] in ("python", "python3") and ("-I" in argv or "-P" in argv), (
        f"Dockerfile: HEALTHCHECK {argv} must run python with -I (or -P): the state directory is its cwd")
    argv[0] = sys.executable
    marker = tmp_path / "planted-ran"
    for name in ("urllib", "http", "email", "base64", "socket", "ssl", "json"):  # what urllib.request imports
        pkg = tmp_path / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    ok = subprocess.run(argv, env={"RMQFAST_HEALTH_URL": admin_url + "/healthz"}, cwd=tmp_path,
                        capture_output=True, timeout=30)
    assert not marker.exists(), f"HEALTHCHECK ran a module planted in its working directory: {marker.read_text()}"
    assert ok.returncode == 0, f"HEALTHCHECK failed against a healthy endpoint: {ok.stderr.decode()}"


def dockerignored(path: str, patterns: list[str]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        if pat.startswith("**/"):
            tails = ["/".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]
            if any(fnmatch.fnmatchcase(t, pat[3:]) for t in tails):
                return True
        elif any(fnmatch.fnmatchcase(p, pat) for p in prefixes):
            return True
    return False


def test_dockerignore_keeps_the_build_inputs() -> None:
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "negated patterns: extend dockerignored() first"
    copied = []
    for instr, args in dockerfile_stages()[0]["lines"]:
        if instr == "COPY" and "--from" not in args:
            copied += args.split()[:-1]
    assert copied, "Dockerfile: the builder stage copies no sources"
    for src in copied:
        assert (ROOT / src).exists(), f"Dockerfile: COPY {src}: no such file in the repository"
        files = [src] if (ROOT / src).is_file() else [
            str(p.relative_to(ROOT)) for p in (ROOT / src).rglob("*") if p.is_file() and "__pycache__" not in p.parts
            and p.suffix not in (".so", ".c", ".html")]
        for f in files:
            assert not dockerignored(f, patterns), f".dockerignore excludes {f}, which the build needs"
    assert dockerignored("ext/_speedups.pyx", patterns) is False
    for junk in ("rmqfast/_speedups.cpython-311-x86_64-linux-gnu.so", ".git/config", ".venv/bin/python",
                 "rmqfast/__pycache__/x.pyc", "java/target/a.jar"):
        assert dockerignored(junk, patterns), f".dockerignore lets {junk} into the build context"


# --------------------------------------------------------------------------------------------
# systemd


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax: sections, repeated keys kept in order, backslash continuations."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for raw in re.sub(r"\\\n", " ", text).splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out.setdefault(section, {})
            continue
        key, sep, value = line.partition("=")
        assert sep and section, f"deploy/systemd/rmqfast.service: cannot read line {raw!r}"
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "SystemCallArchitectures": "native",
}


def test_systemd_unit_structure() -> None:
    unit = parse_unit(UNIT.read_text())
    svc = unit["Service"]

    def last(key: str) -> str:
        assert key in svc, f"deploy/systemd/rmqfast.service: [Service] has no {key}="
        return svc[key][-1]

    assert last("Type") == "notify"
    assert svc.get("NotifyAccess", ["main"])[-1] == "main"  # the supervisor is the main PID and notifies
    argv = shlex.split(last("ExecStart"))
    assert argv[0].endswith("/rmqfast")
    args = cli.build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.config == "/etc/rmqfast/rmqfast.toml"
    assert svc["ExecReload"][-1] == "/bin/kill -HUP $MAINPID"
    assert last("KillSignal") == "SIGTERM"
    assert last("KillMode") == "mixed", "KillMode=mixed: only the supervisor gets SIGTERM and drains the workers"
    assert int(last("LimitNOFILE")) >= 65536
    assert svc.get("User") or last("DynamicUser") == "yes", "the service must not run as root"
    for key, want in HARDENING.items():
        assert last(key) == want, f"deploy/systemd/rmqfast.service: {key}={svc.get(key)}; expected {want}"
    families = set(last("RestrictAddressFamilies").split())
    assert families == {"AF_INET", "AF_INET6", "AF_UNIX"}, f"RestrictAddressFamilies={families} (AF_UNIX: notify)"
    assert "@system-service" in svc["SystemCallFilter"]
    assert last("CapabilityBoundingSet") == "", "no capabilities are needed for ports >= 1024"
    assert "WantedBy" in unit["Install"]


def test_systemd_unit_matches_the_sample_config() -> None:
    unit = parse_unit(UNIT.read_text())["Service"]
    cfg = config_mod.load(UNIT_TOML)
    state = "/var/lib/" + unit["StateDirectory"][-1]
    assert cfg.proxy.state_dir == state, f"rmqfast.toml: proxy.state_dir {cfg.proxy.state_dir}; the unit gives {state}"
    stop = float(unit["TimeoutStopSec"][-1])
    assert stop > cfg.proxy.drain_timeout + 5, f"TimeoutStopSec={stop} must exceed drain_timeout + 5"
    env = dict(e.split("=", 1) for v in unit.get("Environment", []) for e in shlex.split(v))
    runtime = "/run/" + unit["RuntimeDirectory"][-1]
    # PROMETHEUS_MULTIPROC_DIR is made by tempfile.mkdtemp() in the supervisor, i.e. under $TMPDIR.
    assert env.get("TMPDIR") == runtime, f"Environment=TMPDIR must be the RuntimeDirectory {runtime}"


def _verify_problems(unit_text: str, tmp: Path) -> list[str]:
    exe = shutil.which("rmqfast") or str(Path(sys.executable).with_name("rmqfast"))
    path = tmp / "rmqfast.service"
    path.write_text(unit_text.replace("/opt/rmqfast/bin/rmqfast", exe))
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    lines = (out.stdout + out.stderr).splitlines()
    problems = [ln for ln in lines if str(path) in ln]
    if out.returncode != 0:
        problems.append(f"exit {out.returncode}: {out.stderr.strip()}")
    return problems


@pytest.mark.parametrize("mutation", [None, "ProtectSystm=strict", "Type=notfy", "RestrictAddressFamilies=AF_BOGUS"])
def test_systemd_analyze_verify(mutation: str | None, tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed; the unit was checked structurally only")
    text = UNIT.read_text()
    if mutation is None:
        assert _verify_problems(text, tmp_path) == []
    else:  # a broken unit must be reported, or the check above proves nothing
        assert _verify_problems(f"{text}\n[Service]\n{mutation}\n", tmp_path)


def test_systemd_analyze_security_exposure(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    exe = shutil.which("rmqfast") or sys.executable
    path = tmp_path / "rmqfast.service"
    path.write_text(UNIT.read_text().replace("/opt/rmqfast/bin/rmqfast", exe))
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(path)],
                         capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([\d.]+)", out.stdout)
    if m is None:
        pytest.skip(f"this systemd-analyze cannot assess a unit file offline: {out.stderr.strip()[:200]}")
    assert float(m.group(1)) <= 3.0, f"exposure {m.group(1)} > 3.0; hardening options were lost:\n{out.stdout}"


# --------------------------------------------------------------------------------------------
# Prometheus and Grafana

METRIC_NAMES_SCRIPT = textwrap.dedent(
    """
    import json
    from prometheus_client import REGISTRY
    from rmqfast.metrics import Metrics
    Metrics()
    print(json.dumps({m.name: m.type for m in REGISTRY.collect() if m.name.startswith("rmqfast_")}))
    """
)

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
}


@pytest.fixture(scope="module")
def metric_names() -> dict[str, str]:
    """Every series name Metrics() exposes -> its metric type (collected in a fresh interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run([sys.executable, "-c", METRIC_NAMES_SCRIPT], capture_output=True, text=True,
                         timeout=60, env=env, check=True)
    families: dict[str, str] = json.loads(out.stdout)
    names = {}
    for fam, typ in families.items():
        for suffix in SUFFIXES.get(typ, ("",)):
            names[fam + suffix] = typ
    assert "rmqfast_requests_total" in names and names.get("rmqfast_worker_up") == "gauge", names
    return names


def dashboard_exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every templating query."""
    out = []

    def walk_panels(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                if "expr" in t:
                    out.append((f"panel {p.get('title')!r}", t["expr"]))
            walk_panels(p.get("panels", []))

    walk_panels(dash.get("panels", []))
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if v.get("type") == "query" and isinstance(q, str):
            out.append((f"variable {v.get('name')!r}", q))
    return out


def dashboard_problems(dash: dict[str, Any], names: dict[str, str]) -> list[str]:
    problems = []
    for where, expr in dashboard_exprs(dash):
        for name in re.findall(r"\brmqfast_[A-Za-z0-9_:]*", expr):
            if name not in names:
                problems.append(f"{where}: {name} is no metric of rmqfast.metrics.Metrics ({expr})")
        for name in re.findall(r"\b(?:rate|irate|increase)\(\s*(rmqfast_[A-Za-z0-9_:]*)", expr):
            if names.get(name) == "gauge":
                problems.append(f"{where}: rate()/increase() over the gauge {name}")
        for name in set(re.findall(r"\brmqfast_[A-Za-z0-9_:]*_total\b", expr)):
            wrapped = len(re.findall(rf"\b(?:rate|irate|increase)\(\s*{name}\b", expr))
            if len(re.findall(rf"\b{name}\b", expr)) > wrapped:
                problems.append(f"{where}: the counter {name} is shown raw; wrap it in rate() or increase()")
    return problems


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_uses_only_real_metrics(metric_names: dict[str, str]) -> None:
    dash = load_dashboard()
    assert dashboard_exprs(dash), "the dashboard has no queries"
    assert dashboard_problems(dash, metric_names) == []


def test_dashboard_covers_the_key_metrics(metric_names: dict[str, str]) -> None:
    used = {n for _, e in dashboard_exprs(load_dashboard()) for n in re.findall(r"\brmqfast_\w+", e)}
    for name in ("rmqfast_requests_total", "rmqfast_bytes_total", "rmqfast_connections_active",
                 "rmqfast_protocol_errors_total", "rmqfast_denied_requests_total", "rmqfast_upstream_errors_total",
                 "rmqfast_topic_messages_total", "rmqfast_worker_up"):
        assert name in used, f"deploy/grafana/rmqfast-dashboard.json: no panel shows {name}"


def test_dashboard_panels_are_well_formed() -> None:
    dash = load_dashboard()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), f"duplicate panel ids {ids}"
    for p in dash["panels"]:
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys(), f"panel {p['title']!r}: incomplete gridPos"
        if p["type"] != "row":
            assert p.get("targets"), f"panel {p['title']!r} has no query"
            assert all(t.get("refId") for t in p["targets"]), f"panel {p['title']!r}: a target has no refId"


@pytest.mark.parametrize(
    "expr",
    [
        "sum(rate(rmqfast_requests_totl[5m]))",          # misspelt
        "sum(rate(rmqfast_request_latency_seconds_bucket[5m]))",  # a histogram that does not exist
        "sum(rate(rmqfast_worker_up_total[5m]))",        # a gauge has no _total series
        "sum(rmqfast_requests)",                         # a counter is exposed as ..._total only
        "sum(rate(rmqfast_connections_active[5m]))",     # rate() over a gauge
        "sum(rmqfast_requests_total)",                   # a raw counter
    ],
)
def test_dashboard_check_catches_a_bad_panel(expr: str, metric_names: dict[str, str]) -> None:
    dash = copy.deepcopy(load_dashboard())
    dash["panels"].append({"id": 999, "type": "timeseries", "title": "bad", "gridPos": {"x": 0, "y": 99, "w": 1,
                                                                                          "h": 1},
                           "targets": [{"refId": "A", "expr": expr}]})
    problems = dashboard_problems(dash, metric_names)
    assert problems and all("'bad'" in p for p in problems), problems


def test_prometheus_scrape_config() -> None:
    scrape = yaml.safe_load(SCRAPE.read_text())
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    assert len(jobs) == len(scrape["scrape_configs"]), "duplicate job_name"
    static = [j for j in jobs.values() if "static_configs" in j]
    k8s = [j for j in jobs.values() if "kubernetes_sd_configs" in j]
    assert static and k8s, "expected a static_configs job and a kubernetes_sd_configs job"
    admin_port = config_mod.load(UNIT_TOML).admin.listen.port  # type: ignore[union-attr]
    for j in jobs.values():
        assert j.get("metrics_path", "/metrics") == "/metrics"
    for j in static:
        for sc in j["static_configs"]:
            for t in sc["targets"]:
                assert t.rsplit(":", 1)[1] == str(admin_port), f"{j['job_name']}: target {t} is not the admin port"
    # The kubernetes job keeps exactly the pods and ports the manifests declare.
    keeps = {r["source_labels"][0]: r["regex"] for j in k8s for r in j["relabel_configs"] if r.get("action") == "keep"}
    for w in workloads():
        labels = w.body["spec"]["template"]["metadata"]["labels"]
        assert re.fullmatch(keeps["__meta_kubernetes_pod_label_app_kubernetes_io_name"],
                            labels["app.kubernetes.io/name"])
        port_re = keeps["__meta_kubernetes_pod_container_port_name"]
        admin = [n for n, p in container_ports(w).items() if p == effective_config(w).admin.listen.port]  # type: ignore[union-attr]
        assert admin and re.fullmatch(port_re, admin[0]), f"{w.where()}: the admin port is not kept by {port_re}"
