"""ray_lock.py REPORT [--provided] -- the Ray wheels the GPU machine lacks, as lock lines.

Runs on the CPU machine (prepare_ray.sh's header says when). REPORT is the JSON of

    pip install --dry-run --ignore-installed --target X --report REPORT --only-binary=:all: \
      --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_17_x86_64 ... \
      'ray[serve]==VERSION'

(pip resolves from the index's metadata without downloading). Prints, in the report's order,
``name==version --hash=sha256:...  # file.whl`` for every wheel of that resolution that neither
the vllm bundle's lock (tools/gpu/bundle/vllm/lock-*.txt), nor the image
(tools/gpu/bundle/image-packages.txt), nor .gpuextra/ (prepare_extras.sh) provides: what
prepare_ray.sh carries. On stderr, the packages taken from those, with their source, and each
pinned version that fails a requirement of the resolution (the image's versions are mostly
unknown: tools/gpu/ray_check.py lists what is unmet on the GPU machine).

With ``--provided`` it prints the others instead, as ``name==version`` (the lock's or
.gpuextra's version where pinned, else the resolved one): the stand-ins that
ray_local_check.sh installs for the vllm bundle and the image.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}
"""Marker values of the GPU machine's interpreter."""


def pinned(path: Path) -> dict[str, str]:
    """name -> version ('' when unpinned) of a lock or package list (``name==v ...  # ...``)."""
    names: dict[str, str] = {}
    for line in path.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            name, _, version = entry.split()[0].partition("==")
            names[canonicalize_name(name)] = version
    return names


def provided() -> dict[str, tuple[str, str]]:
    """name -> (where, version) of what the GPU machine has without this tool."""
    found: dict[str, tuple[str, str]] = {}
    for name, version in pinned(ROOT / "tools/gpu/bundle/image-packages.txt").items():
        found[name] = ("image", version)
    for wheel in sorted((ROOT / ".gpuextra").glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        found[canonicalize_name(name)] = (".gpuextra", version)
    for lock in sorted((ROOT / "tools/gpu/bundle/vllm").glob("lock-*.txt")):
        for name, version in pinned(lock).items():  # first on PYTHONPATH: it wins
            found[name] = (f"vllm {lock.name}", version)
    return found


def main() -> None:
    report, show_provided = sys.argv[1], "--provided" in sys.argv[2:]
    items = json.loads(Path(report).read_text())["install"]
    have = provided()
    for item in items:
        meta, name = item["metadata"], canonicalize_name(item["metadata"]["name"])
        if name in have:
            where, version = have[name]
            print(f"{name}: {where} {version or '(version unknown)'}", file=sys.stderr)
            if show_provided:
                print(f"{name}=={version or meta['version']}")
        elif not show_provided:
            info = item["download_info"]
            sha = info["archive_info"]["hashes"]["sha256"]
            print(f"{name}=={meta['version']} --hash=sha256:{sha}  "
                  f"# {info['url'].rsplit('/', 1)[-1]}")
    for item in items:  # a pinned version outside what the resolution's packages ask for
        extras = item.get("requested_extras") or [""]
        for line in item["metadata"].get("requires_dist", []):
            req = Requirement(line)
            if req.marker is not None and not any(
                    req.marker.evaluate({**ENV, "extra": x}) for x in extras):
                continue
            where, version = have.get(canonicalize_name(req.name), ("", ""))
            if version and not req.specifier.contains(version, prereleases=True):
                print(f"CONFLICT: {item['metadata']['name']} requires {req}, {where} has "
                      f"{version}", file=sys.stderr)


if __name__ == "__main__":
    main()
