"""Download, where the package registries are reachable, the wheels the GPU check installs offline.

    python benchmarks/fetch_gpu_wheels.py --python-version 3.12 --platform manylinux_2_28_x86_64
    python benchmarks/fetch_gpu_wheels.py --python-version 3.11 --platform manylinux_2_28_x86_64 \
        --exclude pyarrow,pandas,numpy          # packages the GPU machine already has

Ask the GPU machine's interpreter for both values (`python -c "import sys, sysconfig;
print(sys.version_info[:2], sysconfig.get_platform())"`; `linux-x86_64` is a manylinux platform
such as `manylinux_2_28_x86_64`). Writes into `--dest` (default `benchmarks/wheels/`, ignored by
git; carry it to the GPU machine with the working tree):

* the wheels for this project's dependencies (pyproject.toml) and for vLLM `speculators` 0.9.0's
  EAGLE-3 drafter, the benchmark's peer — every package except torch and what ships with it;
* `requirements.txt` (installed with dependency resolution, so packages already there are kept)
  and `requirements-no-deps.txt` (`speculators` and `hs-connectors`: their wheels pin
  torchvision/torchaudio and an older transformers that the EAGLE-3 model does not need).

`python -m benchmarks.gpu_check ... --wheels benchmarks/wheels` then installs them with
`pip install --no-index`. Exit code 2 on bad arguments, 1 when pip fails (its output says why).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PEER_NO_DEPS = ["speculators==0.9.0", "hs-connectors==0.9.0"]
# Project dependencies the check never imports: logging is off (wandb), nothing is plotted (matplotlib).
NOT_NEEDED = {"wandb", "matplotlib"}
# What `speculators.models.eagle3` and its loss import beyond this project's own dependencies.
PEER_NEEDS = ["openai", "pydantic", "accelerate", "protobuf", "googleapis-common-protos", "psutil"]
# Pure-Python packages published only as source: built into a wheel here (any platform takes it).
SOURCE_ONLY = ["antlr4-python3-runtime==4.9.3"]
# The GPU machine's torch brings these, and everything torch requires; never downloaded.
WITH_TORCH = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|pytorch-triton.*)$")


def project_requirements() -> list[str]:
    """pyproject.toml's dependencies that the check needs, without torch (the GPU machine keeps its own)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if not WITH_TORCH.match(_name(d)) and _name(d) not in NOT_NEEDED]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("+ " + " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def platform_tags(platform: str) -> list[str]:
    """`platform` and the older manylinux tags its interpreter also takes (pip does not widen an explicit one)."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    glibc, arch = int(m.group(1)), m.group(2)
    return [f"manylinux_2_{v}_{arch}" for v in range(glibc, 16, -1)] + [f"manylinux2014_{arch}"]


def target_args(python_version: str, platform: str) -> list[str]:
    tags = [arg for tag in platform_tags(platform) for arg in ("--platform", tag)]
    return ["--only-binary=:all:", "--python-version", python_version, *tags, "--implementation", "cp"]


def resolve(requirements: Path, dest: Path, python_version: str, platform: str) -> dict[str, str]:
    """name -> version of what `requirements` needs on the target interpreter (pip's own resolver),
    less torch and what torch itself requires (any machine with torch has those)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip(
            "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
            "--target", str(Path(tmp) / "t"), "--find-links", str(dest), *target_args(python_version, platform),
            "-r", str(requirements),
        )  # fmt: skip
        items = json.loads(report.read_text())["install"]
    requires = {_name(i["metadata"]["name"]): i["metadata"].get("requires_dist") or [] for i in items}
    with_torch, todo = set(), [n for n in requires if WITH_TORCH.match(n)]
    while todo:  # torch's closure within the resolved set (extras' requirements are markers: skipped)
        name = todo.pop()
        if name in with_torch or name not in requires:
            continue
        with_torch.add(name)
        todo += [_name(r) for r in requires[name] if "extra ==" not in r]
    return {
        i["metadata"]["name"]: i["metadata"]["version"] for i in items if _name(i["metadata"]["name"]) not in with_torch
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--python-version", required=True, help="the GPU machine's Python, e.g. 3.12")
    parser.add_argument("--platform", required=True, help="its wheel platform tag, e.g. manylinux_2_28_x86_64")
    parser.add_argument("--dest", type=Path, default=ROOT / "benchmarks" / "wheels")
    parser.add_argument("--exclude", default="", help="comma-separated packages the GPU machine already has")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        print(f"error: --python-version={args.python_version!r}: expected e.g. 3.12", file=sys.stderr)
        return 2
    excluded = {_name(x) for x in args.exclude.split(",") if x.strip()}
    dest = args.dest
    dest.mkdir(parents=True, exist_ok=True)
    requirements = dest / "requirements.txt"
    ours = project_requirements()
    peer = [r for r in PEER_NEEDS if _name(r) not in {_name(x) for x in ours}]
    requirements.write_text("\n".join(ours + peer) + "\n")
    (dest / "requirements-no-deps.txt").write_text("\n".join(PEER_NO_DEPS) + "\n")
    try:
        pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(dest), *SOURCE_ONLY)
        resolved = resolve(requirements, dest, args.python_version, args.platform)
        wanted = sorted(f"{name}=={version}" for name, version in resolved.items() if _name(name) not in excluded)
        pip(
            "download", "--quiet", "--no-deps", "--dest", str(dest), "--find-links", str(dest),
            *target_args(args.python_version, args.platform), *wanted, *PEER_NO_DEPS,
        )  # fmt: skip
    except subprocess.CalledProcessError as e:
        print(f"error: pip failed ({e.returncode}); see its output above", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    print(f"{len(wanted) + len(PEER_NO_DEPS)} packages, {size:.0f} MiB of wheels in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
