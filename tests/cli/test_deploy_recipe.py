"""The container recipe (``deploy/Containerfile``) and the DaemonSet that runs its image
(``deploy/daemonset.yaml``) agree, and both agree with the ``ckptcache daemon`` command and
with the deployment ``docs/security.md`` documents. Read from the files alone: no container
engine is needed (building the image is for a machine with a builder)."""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptcache.cli.commands import _parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
#: Where docs/security.md puts a shared node's root daemon ("Deployment defaults").
SOCKET = "/run/ckptcache/daemon.sock"
SHM_DIR = "/dev/shm/ckptcache-0"


def instructions(text: str) -> list[tuple[str, str]]:
    """A Containerfile's instructions, ``(KEYWORD, arguments)``, continuation lines joined and
    comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, "a continuation line ends the file"
    return out


@pytest.fixture(scope="module")
def recipe() -> list[tuple[str, str]]:
    return instructions((DEPLOY / "Containerfile").read_text())


@pytest.fixture(scope="module")
def container() -> dict[str, Any]:
    docs = list(yaml.safe_load_all((DEPLOY / "daemonset.yaml").read_text()))
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (daemon,) = daemonset["spec"]["template"]["spec"]["containers"]
    return {"pod": daemonset["spec"]["template"]["spec"], **daemon}


def final_stage(recipe: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last = max(i for i, (k, _) in enumerate(recipe) if k == "FROM")
    return recipe[last:]


def one(stage: list[tuple[str, str]], keyword: str) -> str:
    (value,) = [v for k, v in stage if k == keyword]
    return value


def flags(args: list[str]) -> dict[str, str]:
    """``--flag=value`` arguments by flag (every one in that form, or a bare switch: "")."""
    assert all(re.fullmatch(r"--[a-z0-9-]+(=\S+)?", a) for a in args), args
    return {flag: value for flag, _, value in (a.partition("=") for a in args)}


def test_the_image_runs_the_daemon_as_root(recipe, container):
    stage = final_stage(recipe)
    entrypoint = json.loads(one(stage, "ENTRYPOINT"))  # exec form: signals reach the daemon
    assert entrypoint[1:] == ["daemon"]
    venv_bin = posixpath.dirname(entrypoint[0])
    assert entrypoint[0] == posixpath.join(venv_bin, "ckptcache")
    assert f"PATH={venv_bin}:" in one(stage, "ENV")
    assert (
        "COPY",
        f"--from=build {posixpath.dirname(venv_bin)} {posixpath.dirname(venv_bin)}",
    ) in (stage)
    assert one(stage, "USER").split(":")[0] in ("0", "root")  # docs/security.md: a root daemon
    assert one(stage, "STOPSIGNAL") == "SIGTERM"  # the daemon's clean shutdown
    # The manifest runs that entry point (no command of its own) and nothing else as its user.
    assert "command" not in container
    assert container.get("securityContext", {}).get("runAsUser", 0) == 0
    assert container["pod"].get("securityContext", {}).get("runAsUser", 0) == 0


def test_torch_is_a_build_argument_cpu_by_default(recipe):
    args = dict(v.partition("=")[::2] for k, v in recipe if k == "ARG")
    assert args["TORCH"] == "cpu" and re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    installs = [v for k, v in recipe if k == "RUN" and "pip install" in v]
    torch_first = installs[0]
    assert "--index-url https://download.pytorch.org/whl/${TORCH}" in torch_first
    assert '"torch==${TORCH_VERSION}"' in torch_first
    # The project's install names the same torch, so no requirement swaps the build out.
    assert any("/src" in v and '"torch==${TORCH_VERSION}"' in v for v in installs[1:])
    copied = {p for k, v in recipe if k == "COPY" and not v.startswith("--from")
              for p in v.split()[:-1]}  # fmt: skip
    needed = {"pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "ckptcache-startup.pth",
              "ckptcache"}  # fmt: skip
    assert needed <= copied and all((REPO / p).exists() for p in copied)


def test_the_manifests_flags_are_the_daemon_commands(recipe, container):
    """The args reach ``ckptcache daemon`` (the entry point): its own parser takes them, and
    the socket and segment directory are the recipe's defaults, which are the documented
    ones."""
    args = container["args"]
    parsed = _parser().parse_args(["daemon", *args])  # exits on an unknown flag
    assert parsed.fn.__name__ == "_cmd_daemon"
    given = flags(args)
    assert given["--socket"] == SOCKET and given["--shm-dir"] == SHM_DIR
    assert parsed.keep_on_stop  # a restart (an upgrade) keeps the node's warm cache
    defaults = flags(json.loads(one(final_stage(recipe), "CMD")))
    assert defaults == {"--socket": SOCKET, "--shm-dir": SHM_DIR}
    assert {"name": "CKPTCACHE_NODE_ID",
            "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container["env"]  # fmt: skip


def test_what_the_flags_name_is_mounted(container):
    given = flags(container["args"])
    volumes = {v["name"]: v for v in container["pod"]["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}

    def volume_of(path: str) -> dict[str, Any]:
        holders = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
        assert holders, f"{path} is on no mounted volume"
        return mounts[max(holders, key=len)]

    # The socket and the segments on the host, where the node's trainer pods reach them.
    assert volume_of(posixpath.dirname(given["--socket"]))["hostPath"]["path"] == "/run/ckptcache"
    assert volume_of(given["--shm-dir"])["hostPath"]["path"] == "/dev/shm"
    assert volume_of(given["--secret-file"])["secret"]["defaultMode"] == 0o400
    secret_mount = next(m for m in container["volumeMounts"] if m["name"] == "secret")
    assert secret_mount.get("readOnly") is True


def test_capabilities_ports_and_network(recipe, container):
    # CAP_LINUX_IMMUTABLE seals admitted users' segments (docs/security.md); nothing else added.
    capabilities = container["securityContext"]["capabilities"]
    assert capabilities["add"] == ["LINUX_IMMUTABLE"]
    assert "LINUX_IMMUTABLE" not in capabilities.get("drop", [])
    assert "CAP_LINUX_IMMUTABLE" in (REPO / "docs" / "security.md").read_text()
    given = flags(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"data": int(given["--listen"].rsplit(":", 1)[1]),
                     "metrics": int(given["--metrics-port"])}  # fmt: skip
    exposed = {int(p) for p in one(final_stage(recipe), "EXPOSE").split()}
    assert exposed == set(ports.values())
    assert container["pod"]["hostNetwork"] is True  # peers dial the node's address


def test_the_image_name_is_the_one_the_build_command_makes(container):
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert version is not None
    image = container["image"]
    assert image == f"your-registry/ckptcache:{version.group(1)}"
    command = f"docker build -f deploy/Containerfile -t {image} ."
    for where in ("deploy/Containerfile", "deploy/daemonset.yaml", "docs/cluster.md"):
        assert command in (REPO / where).read_text(), where


def test_the_systemd_unit_runs_the_same_daemon():
    unit = (DEPLOY / "ckptcache.service").read_text().replace("\\\n", " ")
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(exec_start.removeprefix("ExecStart="))
    assert os.path.basename(argv[0]) == "ckptcache" and argv[1] == "daemon"
    parsed = _parser().parse_args(argv[1:])
    assert (parsed.socket, parsed.shm_dir) == (SOCKET, SHM_DIR)
    assert parsed.keep_on_stop  # a restart (an upgrade) keeps the node's warm cache
