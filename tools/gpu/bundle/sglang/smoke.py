"""Smoke test of the sglang bundle on the GPU machine.

device_step.sh runs it once the bundle is installed; later: source /tmp/site-sglang/env.sh &&
python3 /tmp/site-sglang/_smoke.py. Every check runs and reports; the exit code is 1 if any failed.
With SMOKE_CPU=1 (local_check.sh on the CPU machine) only the imports and `--help` run.
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


def launch_help():
    r = subprocess.run([sys.executable, '-m', 'sglang.launch_server', '--help'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and '--model-path' in r.stdout, (r.returncode, r.stderr[-600:])
    return f'{len(r.stdout.splitlines())} lines of help'


check('versions', versions)
if not IS_CPU:
    check('torch + CUDA', gpu)
    check('triton kernel', triton_kernel)
    check('sgl_kernel rmsnorm', sgl_kernel_ops)
    check('FA3 (sgl_kernel)', fa3)
check('flashinfer import', flashinfer_import)
check('server imports', server_modules)
check('launch_server --help', launch_help)
print(f'SMOKE {"FAILED: " + ", ".join(failures) if failures else "passed"}')
sys.exit(1 if failures else 0)
