"""Smoke test of the sglang bundle on the GPU machine.

device_step.sh runs it once the bundle is installed; later: source /tmp/site-sglang/env.sh &&
python3 /tmp/site-sglang/_smoke.py. Every check runs and reports; the exit code is 1 if any failed.
With SMOKE_CPU=1 (local_check.sh on the CPU machine) only the imports, the CPU form of the model
build and `--help` run. `python3 smoke.py --build` is the model build alone (a subprocess of the
smoke test: it sets up torch.distributed and SGLang's parallel groups).
"""
import importlib
import importlib.metadata as md
import os
import subprocess
import sys
import time

IS_CPU = os.environ.get('SMOKE_CPU') == '1'
# the modules a Qwen2/MiMo (+MTP) server with the FA3, Triton or FlashInfer backend imports
SERVER_MODULES = [
    'sglang.launch_server', 'sglang.srt.entrypoints.http_server', 'sglang.srt.entrypoints.engine',
    'sglang.srt.managers.tokenizer_manager', 'sglang.srt.managers.detokenizer_manager',
    'sglang.srt.managers.scheduler', 'sglang.srt.model_executor.model_runner',
    'sglang.srt.models.qwen2', 'sglang.srt.models.mimo', 'sglang.srt.models.mimo_mtp',
    'sglang.srt.speculative.eagle_worker_v2', 'sglang.srt.layers.sampler',
    'sglang.srt.layers.attention.flashattention_backend', 'sglang.srt.layers.attention.triton_backend',
    'sglang.srt.layers.attention.flashinfer_backend', 'sglang.srt.constrained.xgrammar_backend',
    # imported lazily, on CUDA only, by every Qwen2-family MLP's DualGemm (model construction);
    # it imports the CuTe DSL (`cutlass`), which the bundle had pruned until the H200 found it
    'sglang.srt.layers.dual_gemm', 'sglang.kernels.ops.gemm.cutedsl_dual_gemm',
    # imported on CUDA by the EAGLE/MTP draft worker's CUDA-graph capture whatever the backend
    # (eagle_worker_v2._capture_cuda_graphs); the last imports `flash_mla` (sgl-flash-mla), which the
    # bundle had pruned until the H200's first start with CUDA graphs found it
    'sglang.srt.layers.attention.dsa_backend', 'sglang.srt.layers.attention.deepseek_v4_backend',
    'sglang.srt.layers.attention.flashmla_backend',
]
failures = []


def check(name, fn):
    t0 = time.time()
    try:
        detail = fn()
        print(f'  ok   {name} ({time.time() - t0:.1f} s){": " + detail if detail else ""}', flush=True)
    except BaseException as e:  # report every failure, then exit 1
        failures.append(name)
        print(f'  FAIL {name}: {type(e).__name__}: {str(e)[:400]}', flush=True)


def versions():
    import torch
    names = ['sglang', 'sglang-kernel', 'flashinfer-python', 'torch', 'triton', 'transformers',
             'nvidia-nccl-cu13', 'nvidia-cudnn-cu13', 'nvidia-cublas', 'nvidia-cuda-runtime',
             'nvidia-cusparselt-cu13', 'nvidia-nvshmem-cu13', 'cuda-bindings', 'numpy']
    found = ' '.join(f'{n}={_version(n)}' for n in names)
    return (f'{found} (nvidia-*: the image\'s dists; the NCCL loaded is the bundle\'s, see below) '
            f'| torch cuda {torch.version.cuda} available {torch.cuda.is_available()}')


def _version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return '-'


def gpu():
    import torch
    assert torch.cuda.is_available(), 'torch sees no GPU'
    p = torch.cuda.get_device_properties(0)
    x = torch.randn(256, 256, device='cuda')
    assert torch.allclose(x @ x, (x.double() @ x.double()).float(), atol=1e-2)
    return f'{p.name} cc {p.major}.{p.minor} | nccl {torch.cuda.nccl.version()} | cudnn {torch.backends.cudnn.version()}'


def triton_kernel():
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m) + 1.0, mask=m)

    x = torch.arange(1000, device='cuda', dtype=torch.float32)
    y = torch.empty_like(x)
    add_one[(4,)](x, y, 1000, BLOCK=256)
    assert torch.equal(y, x + 1)
    return f'triton {triton.__version__}'


def sgl_kernel_ops():
    import torch
    import sgl_kernel
    x = torch.randn(8, 512, device='cuda', dtype=torch.bfloat16)
    w = torch.randn(512, device='cuda', dtype=torch.bfloat16)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float())
    out = sgl_kernel.rmsnorm(x, w, 1e-6)
    assert torch.allclose(out.float(), ref, atol=5e-2, rtol=2e-2), (out.float() - ref).abs().max()
    return f'sgl_kernel {sgl_kernel.__version__} rmsnorm ok'


def fa3():
    import torch
    from sgl_kernel.flash_attn import flash_attn_varlen_func, is_fa3_supported
    assert is_fa3_supported(), 'FA3 not supported on this GPU'
    seq, heads, dim = 64, 4, 128
    q, k, v = (torch.randn(seq, heads, dim, device='cuda', dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, seq], device='cuda', dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen_q=seq, max_seqlen_k=seq, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(0, 1)
    err = (out.float() - ref.float()).abs().max().item()
    assert err < 2e-2, f'FA3 differs from SDPA by {err}'
    return f'FA3 varlen causal vs SDPA max err {err:.4f}'


def flashinfer_import():
    import flashinfer
    return f'flashinfer {flashinfer.__version__} (kernels JIT-compile with the image nvcc on first use)'


def server_modules():
    for m in SERVER_MODULES:
        importlib.import_module(m)
    return f'{len(SERVER_MODULES)} modules'


def cute_dsl():
    # nvidia-cutlass-dsl: `cutlass` lives in <site>/nvidia_cutlass_dsl/dsl_packages, which its .pth
    # file would add to sys.path; .pth files are not read from PYTHONPATH, so env.sh names the folder
    import cutlass
    import cutlass.cute  # noqa: F401
    ir = sys.modules['cutlass._mlir._mlir_libs._cutlass_ir']
    return f'cutlass {cutlass.__version__} from {os.path.dirname(cutlass.__file__)}; IR library {os.path.basename(ir.__file__)}'


def flash_mla_import():
    # sgl-flash-mla: two torch extensions loaded with torch.ops.load_library (a dlopen needing
    # libcudart.so.13, libcuda.so.1 and torch's CUDA libraries); the SM90 kernels are the legacy one's
    import flash_mla
    assert flash_mla.has_legacy(), 'no legacy (SM90) FlashMLA kernels'
    import torch
    names = torch._C._dispatch_get_all_op_names()
    ops = {ns: sum(n.startswith(ns + '::') for n in names) for ns in ('flash_mla', 'flash_mla_legacy')}
    assert all(ops.values()), f'ops registered: {ops}'
    return (f'flash_mla {flash_mla.__version__} from {os.path.dirname(flash_mla.__file__)}; ops '
            + ', '.join(f'{ns}: {n}' for ns, n in ops.items()))


def model_build():
    r = subprocess.run([sys.executable, os.path.abspath(__file__), '--build'],
                       capture_output=True, text=True, timeout=300)
    lines = [l for l in r.stdout.splitlines() if l.startswith('BUILD ')]
    for l in r.stdout.splitlines():   # the full list, for smoke.log (device_step.sh shows less)
        if l.startswith('new modules: '):
            print(l)
    if r.returncode != 0 or not lines:   # the traceback into smoke.log, its last line below
        tail = (r.stdout + r.stderr).strip().splitlines()[-30:]
        print('\n'.join('build> ' + l for l in tail))
        raise RuntimeError(f'exit {r.returncode}: {tail[-1] if tail else "no output"}')
    return ' | '.join(l[6:] for l in lines)


def build_main():
    """Construct what SGLang constructs for a Qwen2/MiMo (+MTP) server, without a checkpoint.

    GPU: tiny Qwen2ForCausalLM, MiMoForCausalLM and MiMoMTP on CUDA in bf16 (the constructors take
    their CUDA branches, e.g. every MLP's DualGemm imports the CuTe DSL). CPU (SMOKE_CPU=1): the
    constructors would take CPU branches that are not the GPU's (RoPE wants vllm's ops there), so
    only a Qwen2MLP is built, with DualGemm's is_cuda() forced true: its CUDA-only import runs, its
    sm_100 test then says no. Prints `BUILD ...` lines; exit 1 on any failure.
    """
    import socket
    import torch
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    for k, v in dict(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK='0', WORLD_SIZE='1',
                     LOCAL_RANK='0').items():
        os.environ[k] = v
    # what sglang.test.layer_ut_utils.init_single_process_dist does (its module imports the pruned
    # `datasets`): a world of one, SGLang's runtime context published, the model-parallel groups
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend='gloo')
    reset_context()
    publish(ServerArgs(model_path='dummy', tp_size=1, ep_size=1, pp_size=1), role='test',
            ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=ps._WORLD)
    ps.initialize_model_parallel(backend='gloo')
    torch.set_default_dtype(torch.bfloat16)
    before = set(sys.modules)
    if IS_CPU:
        import sglang.srt.layers.dual_gemm as dual_gemm
        from sglang.srt.models.qwen2 import Qwen2MLP
        dual_gemm.is_cuda = lambda: True
        mlp = Qwen2MLP(512, 1024, 'silu', prefix='model.layers.0.mlp')
        built = [f'Qwen2MLP (CPU, DualGemm CUDA branch forced: mode {mlp.dual_gemm.mode})']
    else:
        from transformers import Qwen2Config
        from sglang.srt.models.mimo import MiMoForCausalLM
        from sglang.srt.models.mimo_mtp import MiMoMTP
        from sglang.srt.models.qwen2 import Qwen2ForCausalLM
        cfg = Qwen2Config(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          tie_word_embeddings=False)
        cfg.num_nextn_predict_layers = 1
        built = []
        with torch.device('cuda'):
            for cls in (Qwen2ForCausalLM, MiMoForCausalLM, MiMoMTP):
                m = cls(cfg)
                n = sum(p.numel() for p in m.parameters())
                dev = next(m.parameters()).device
                built.append(f'{cls.__name__} ({n / 1e6:.1f}M params on {dev})')
                del m
    new = sorted(set(sys.modules) - before)
    tops = sorted({m.split('.')[0] for m in new} - {'sglang', 'transformers'})
    print('BUILD ' + ', '.join(built))
    print(f'BUILD imported {len(new)} more modules ({sum(m.startswith("sglang.") for m in new)} of sglang); '
          f'other packages: {" ".join(tops) or "none"}')
    print('new modules: ' + ' '.join(new))
    torch.distributed.destroy_process_group()
    sys.exit(0)


def launch_help():
    r = subprocess.run([sys.executable, '-m', 'sglang.launch_server', '--help'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and '--model-path' in r.stdout, (r.returncode, r.stderr[-600:])
    return f'{len(r.stdout.splitlines())} lines of help'


if sys.argv[1:] == ['--build']:
    build_main()
check('versions', versions)
if not IS_CPU:
    check('torch + CUDA', gpu)
    check('triton kernel', triton_kernel)
    check('sgl_kernel rmsnorm', sgl_kernel_ops)
    check('FA3 (sgl_kernel)', fa3)
check('flashinfer import', flashinfer_import)
check('CuTe DSL import', cute_dsl)
check('FlashMLA import', flash_mla_import)
check('server imports', server_modules)
# GPU: tiny Qwen2/MiMo/MiMo-MTP models built on CUDA; CPU: a Qwen2 MLP only (see build_main)
check('model build (GPU: Qwen2, MiMo, MiMo MTP on CUDA)' if not IS_CPU else
      'model build (CPU: Qwen2 MLP, DualGemm CUDA branch forced)', model_build)
check('launch_server --help', launch_help)
print(f'SMOKE {"FAILED: " + ", ".join(failures) if failures else "passed"}')
sys.exit(1 if failures else 0)
