"""ray_check.py [--smoke] -- can this Python path run Ray Serve?

Runs where Ray was installed by tools/gpu/ray_env.sh: on the GPU machine after the vllm bundle
and project_env.sh (ray_env.sh calls it once), or on the CPU machine under
tools/gpu/ray_local_check.sh. Prints Ray's version and where it lies, then every requirement
of ``ray[serve]``, followed through the packages found, that this path does not meet (missing,
or a version outside the requirement: the image's versions are mostly unknown before this
runs), then imports Ray Serve's modules. ``--smoke`` then starts a local Ray, runs a Serve app
of one deployment behind Serve's HTTP proxy, sends it one request and prints the cluster's
resources (a GPU machine's ``GPU`` count is what fractional replicas are placed by).

Exit status: 1 when an import or the smoke test fails; an unmet requirement alone is printed,
not fatal (vLLM's pins win over Ray's on purpose, and a few of them miss).
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import socket
import sys
import time
import urllib.request

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

MODULES = ("ray", "ray.serve", "ray.serve.handle", "ray.util.state", "ray.cluster_utils",
           "ray.serve._private.proxy", "ray.dashboard.modules.reporter.reporter_agent")
"""What the project's Ray code and a Serve deployment import (the last: the dashboard
agent, which Ray starts when Serve's optional dependencies are present)."""


def unmet(root: str, extras: tuple[str, ...]) -> list[str]:
    """Requirements reachable from ``root[extras]`` that this path does not meet."""
    problems: list[str] = []
    seen: set[str] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        if canonicalize_name(name) in seen:
            continue
        seen.add(canonicalize_name(name))
        for line in metadata.requires(name) or ():
            req = Requirement(line)
            if req.marker is not None and not any(
                    req.marker.evaluate({"extra": x}) for x in ("", *wanted)):
                continue
            try:
                version = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{name}: {req} -> missing")
                continue
            if not req.specifier.contains(version, prereleases=True):
                problems.append(f"{name}: {req} -> {version}")
            todo.append((req.name, tuple(req.extras)))
    return problems


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def smoke() -> None:
    """A local Ray, one Serve deployment behind Serve's proxy, one request."""
    import ray
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Echo:
        async def __call__(self, request: object) -> str:
            return "ray serve ok"

    start = time.monotonic()
    ray.init(address="local", num_cpus=2)  # a cluster of its own, never one found running
    try:
        print(f"ray cluster resources: {ray.cluster_resources()}")
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(Echo.bind(), name="ray-check", route_prefix="/")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=60) as response:
            body = response.read().decode()
        if body != "ray serve ok":
            raise RuntimeError(f"the Serve app answered {body!r}")
        print(f"serve smoke test: ok in {time.monotonic() - start:.1f} s")
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> int:
    print(f"python {sys.version.split()[0]}, ray {metadata.version('ray')} from "
          f"{metadata.distribution('ray').locate_file('')}")
    problems = unmet("ray", ("serve",))
    print(f"ray[serve] requirements unmet on this path: {len(problems)}")
    for problem in problems:
        print(f"  {problem}")
    for module in MODULES:
        importlib.import_module(module)
    print(f"imports ok: {', '.join(MODULES)}")
    if "--smoke" in sys.argv[1:]:
        smoke()
    return 0


if __name__ == "__main__":
    sys.exit(main())
