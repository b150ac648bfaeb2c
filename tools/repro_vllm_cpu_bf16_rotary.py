"""Issue 35 / decision 0040, without vLLM: the bfloat16 rotary embedding as vLLM 0.32's
`RotaryEmbedding.forward_native` computes it (neox style: o1 = x1*cos - x2*sin, o2 = x2*cos + x1*sin,
cos/sin cast to the query's dtype), eager against `torch.compile(backend="inductor")`, with and
without `torch._inductor.config.emulate_precision_casts`; RMSNorm and SiLU-and-mul as vLLM's native
forms beside it. Prints the share of output elements that differ and the largest difference.

Run: `OMP_NUM_THREADS=1 python tools/repro_vllm_cpu_bf16_rotary.py` (torch only).
"""
from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

BF16 = torch.bfloat16


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x.to(w.dtype) * w).to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    freqs = torch.outer(torch.arange(13).float(), 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64)))
    cases = (("rotary_embedding", rope, (torch.randn(13, 9, 64, dtype=BF16) * 3, freqs.cos(), freqs.sin())),
             ("rms_norm", rms_norm, (torch.randn(13, 576, dtype=BF16) * 4, torch.randn(576, dtype=BF16))),
             ("silu_and_mul", silu_and_mul, (torch.randn(13, 3072, dtype=BF16) * 3,)))
    for emulate in (False, True):
        inductor_config.emulate_precision_casts = emulate
        torch._dynamo.reset()
        for name, fn, args in cases:
            eager = fn(*args)
            compiled = torch.compile(fn, backend="inductor", dynamic=True)(*args)
            print(f"emulate_precision_casts={emulate} {name}: {(eager != compiled).float().mean().item():.1%} of "
                  f"elements differ, max {(eager.float() - compiled.float()).abs().max().item()}", flush=True)


if __name__ == "__main__":
    main()
