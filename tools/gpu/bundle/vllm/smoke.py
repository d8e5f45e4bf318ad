"""Smoke test of the vllm bundle on the GPU machine (device_step.sh runs it; later: python3 /tmp/site/_smoke.py)."""
import torch, vllm
import vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch  # CUDA 13 extensions vs torch 2.13
import torchvision, triton, triton.language as tl
from vllm.vllm_flash_attn.flash_attn_interface import FA2_AVAILABLE, FA3_AVAILABLE
from vllm.platforms import current_platform


@triton.jit
def _add(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m) + 1.0, mask=m)


x = torch.arange(1000, device="cuda", dtype=torch.float32); y = torch.empty_like(x)
_add[(4,)](x, y, 1000, BLOCK=256); torch.cuda.synchronize()
ok = bool(torch.equal(y, x + 1)) and float((x @ x).item()) > 0
print(f"  torch {torch.__version__} cuda {torch.cuda.is_available()} | vllm {vllm.__version__}")
print(f"  gpu {torch.cuda.get_device_name(0)} cc {current_platform.get_device_capability()} "
      f"| nccl {torch.cuda.nccl.version()} | torchvision {torchvision.__version__} "
      f"| triton {triton.__version__} kernel {'ok' if ok else 'WRONG'} | FA3 {FA3_AVAILABLE} FA2 {FA2_AVAILABLE} "
      f"| _C ops {hasattr(torch.ops._C, 'rotary_embedding')}")
assert ok
