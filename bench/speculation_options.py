"""``bench/speculation.py``'s command line, checked: the drafters, the modes, the
workloads and the engines' share of the GPU (``parse_options``)."""

from __future__ import annotations

import argparse

from bench.engine_options import add_device_arguments
from bench.speculation_report import mode_name
from bench.speculation_rounds import levels_arg

GPU_MEMORY_SHARED = 0.85
"""The GPU memory fraction the bench's engines share by default (vLLM's own default for
one engine is 0.9; the rest is the CUDA contexts' and the graphs')."""
GPU_MEMORY_PER_ENGINE = 0.4
"""At most this fraction per engine by default: the 1B model and its KV cache need less."""


def per_engine_memory(requested: float | None, *, num_engines: int) -> float:
    """``--gpu-memory-utilization`` for each of ``num_engines`` engines on one GPU: the
    request, or the default share (:data:`GPU_MEMORY_SHARED` split, at most
    :data:`GPU_MEMORY_PER_ENGINE`). vLLM takes the fraction of the whole GPU per engine and
    refuses an engine that finds less free, so three at 0.4 failed at start-up.

    Raises:
        ValueError: the request over all engines passes the whole GPU.
    """
    if requested is None:
        return round(min(GPU_MEMORY_PER_ENGINE, GPU_MEMORY_SHARED / num_engines), 2)
    if not 0 < requested * num_engines <= 1:
        raise ValueError(f"--gpu-memory-utilization: {requested} for each of {num_engines} "
                         f"engines is {requested * num_engines:.2f} of the GPU; give at most "
                         f"{1 / num_engines:.2f}")
    return requested


def parse_options(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[float]]:
    """The command line, checked (``parser.error`` names the flag): the options, with
    ``static_k``, ``drafter_at_k0`` and ``profile_modes`` as lists, and the drafter
    noises."""
    parser = argparse.ArgumentParser(description=(
        "The speculation control against static K and no speculation: does it ever slow "
        "rollout? (bench/speculation.py)"))
    parser.add_argument("--model", default="embedded:small",
                        help="embedded:<size> (tiny, small, 1b, 7b)")
    parser.add_argument("--draft-noise", default="0.25",
                        help="comma-separated drafter noises, one checkpoint (and run) each")
    parser.add_argument("--k-max", type=int, default=3, help="the spec engine's largest K")
    parser.add_argument("--static-k", default=None, help="comma-separated K values to pin "
                        "as static modes (default: 0 .. k-max)")
    parser.add_argument("--full-cuda-graphs", choices=("align", "as_is"), default="align",
                        help="speculation_control.full_cuda_graphs of the spec engines")
    parser.add_argument("--drafter-at-k0", default="auto",
                        help="comma-separated speculation_control.drafter_at_k0 values, one "
                             "spec engine each (run,skip: the A/B on one run; skip: "
                             "model runner V2 on CUDA only; auto: skip where it can)")
    parser.add_argument("--profile-modes", default="",
                        help="comma-separated modes (spec-off, k=<K>, controller) to sample "
                             "with py-spy, service and engine core, every round")
    parser.add_argument("--profile-dir", default="bench-speculation-profiles", help="where "
                        "--profile-modes writes (read with bench.profile_summary)")
    parser.add_argument("--frozen", action="store_true", help="one more mode: the "
                        "controller's own schedule as it stood before the round, pinned (the "
                        "controller's K without its deciding during the round)")
    parser.add_argument("--stale-drafter", action="store_true", help="one more run: the first "
                        "noise's drafter after a main push of another seed's model")
    parser.add_argument("--stale-only", action="store_true", help="the stale run alone "
                        "(the first noise's services, no fresh run before it)")
    parser.add_argument("--concurrency", type=levels_arg, default="1,4,16,64",
                        help="comma-separated levels (empty: the rollout only)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--waves", type=int, default=1,
                        help="a fixed-concurrency round sends c x WAVES requests, c in flight "
                        "(closed loop), a rollout round runs WAVES rollouts back to back: "
                        "longer rounds, less spread (16 x 256 tokens: < 1 s on a GPU)")
    parser.add_argument("--rollout-prompts", type=int, default=512,
                        help="prompts of the decaying rollout (0: no rollout)")
    parser.add_argument("--rollout-max-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-capture-tokens", type=int, default=None,
                        help="CUDA: vLLM's max_cudagraph_capture_size for every engine "
                             "(default: vLLM's 512 tokens for spec-off, the service's "
                             "(k_max + 1) x 512 for the controlled engines)")
    parser.add_argument("--calibration-max-batch-size", type=int, default=32,
                        help="the controller's start-up calibration grid goes up to this")
    add_device_arguments(parser, gpu_memory_utilization=None, engines=(
        "spec-off's and one per --drafter-at-k0 value at once; default: "
        f"{GPU_MEMORY_SHARED} shared among them, at most {GPU_MEMORY_PER_ENGINE} each"))
    opts = parser.parse_args(argv)
    if not opts.model.startswith("embedded:"):
        parser.error("--model: embedded:<size> only (each drafter noise is generated)")
    if opts.rounds < 1 or opts.k_max < 1 or opts.waves < 1:
        parser.error("--rounds, --k-max and --waves must be >= 1")
    try:
        noises = [float(x) for x in opts.draft_noise.split(",")]
    except ValueError:
        parser.error(f"--draft-noise: comma-separated numbers, got {opts.draft_noise!r}")
    try:
        opts.static_k = (list(range(opts.k_max + 1)) if opts.static_k is None
                         else [int(k) for k in opts.static_k.split(",")])
    except ValueError:
        parser.error(f"--static-k: comma-separated integers, got {opts.static_k!r}")
    if any(not 0 <= k <= opts.k_max for k in opts.static_k):
        parser.error(f"--static-k: each K in 0 .. --k-max ({opts.k_max})")
    opts.drafter_at_k0 = opts.drafter_at_k0.split(",")
    if not opts.drafter_at_k0 or set(opts.drafter_at_k0) - {"run", "skip", "auto"} or len(
            set(opts.drafter_at_k0)) != len(opts.drafter_at_k0):
        parser.error("--drafter-at-k0: distinct values among run, skip, auto")
    opts.profile_modes = [m for m in opts.profile_modes.split(",") if m]
    known = {"spec-off", *(mode_name(m, d, opts.drafter_at_k0) for d in opts.drafter_at_k0
                           for m in ("controller", *(["frozen"] if opts.frozen else []),
                                     *(f"k={k}" for k in opts.static_k)))}
    if unknown := set(opts.profile_modes) - known:
        parser.error(f"--profile-modes: {sorted(unknown)} not among the modes {sorted(known)}")
    try:
        opts.gpu_memory_utilization = per_engine_memory(
            opts.gpu_memory_utilization, num_engines=1 + len(opts.drafter_at_k0))
    except ValueError as exc:
        parser.error(str(exc))
    return opts, noises
