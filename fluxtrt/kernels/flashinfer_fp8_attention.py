"""fp8-attn's attention through FlashInfer's FP8 prefill on Hopper (its FlashAttention-3 template, `backend="fa3"`:
warp-specialised, wgmma, TMA, V transposed in shared memory), a candidate beside our Triton kernel
(kernels/fp8_attention.py) and cuDNN's (kernels/cudnn_fp8_attention.py), measured by scripts/fp8_attention_bench.py.

The operands are E4M3 codes of q*c/sq, k*c/sk and v/sv (c = sqrt(1/sqrt(d)), fp8.sdpa_root_scale), laid out as
FlashInfer's single-request prefill takes them: [tokens, heads, d] ("NHD"), the batch folded into the heads
([S, B*H, D]; for B = 1 the processor's own [B, S, H, D] as it is). FlashInfer's DefaultFP8Attention computes
S = Q8 K8^T * sq sk (sm_scale 1: c is in the codes), the online softmax in fp32, each block's exp(S - m) times 448
rounded to E4M3, O = P8 V8 * sv / 448 / l in bf16: the arithmetic of `fp8_attention.kernel_arithmetic` with
blocks of 192 keys (its CTA_KV for d 128) visited from the last (FA3's mainloop walks the key tiles backwards;
walked forwards, the arithmetic differed from the H100's output by 3.5%, the P roundings falling elsewhere).

Needs the `flashinfer` package (pip flashinfer-python; it JIT-compiles the kernel with nvcc on first use, cached
under ~/.cache/flashinfer) and an sm90 GPU: `available()` says whether it runs here. The call is a torch custom
op (`fluxtrt::fa3_fp8_attention`, registered on import; flashinfer is imported only when it runs), so
torch.compile and CUDA graphs keep it whole."""

import torch

BLOCK_N = 192  # the keys FlashInfer's sm90 FP8 prefill takes per block at d 128 (prefill_sm90.cuh's CTA_KV)
WALK = {"block_n": BLOCK_N, "reverse": True}  # its key blocks, last first: kernel_arithmetic's / on_codes' keywords


def available() -> str | None:
    """None where FlashInfer's FP8 attention can run here, else why not (one line)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return "FlashInfer's FP8 attention (its FA3 template) needs a Hopper (sm90) GPU"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # ImportError, or a missing dependency of it
        return f"the flashinfer module (pip flashinfer-python) does not import here ({type(e).__name__}: {e})"
    return None


@torch.library.custom_op("fluxtrt::fa3_fp8_attention", mutates_args=())
def fa3_fp8_attention(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: list[float]) -> torch.Tensor:
    """q8, k8, v8 [S, heads, D] E4M3 and [sq, sk, sv] -> [S_q, heads, D] bf16 (FlashInfer's FA3 FP8 prefill)."""
    from flashinfer import single_prefill_with_kv_cache

    sq, sk, sv = scales  # one scale for all heads: FlashInfer's scalar form of its per-head scales
    return single_prefill_with_kv_cache(q8, k8, v8, scale_q=sq, scale_k=sk, scale_v=sv, o_dtype=torch.bfloat16,
                                        sm_scale=1.0, backend="fa3")


@fa3_fp8_attention.register_fake
def _(q8, k8, v8, scales):
    return q8.new_empty(q8.shape, dtype=torch.bfloat16)


def operands(q, k, v, scales):
    """The kernel's operands from q, k, v [B, S, H, D] (after RoPE) and the recipe's (sq, sk, sp, sv): E4M3 codes
    of q*c/sq, k*c/sk and v/sv, each [S, B*H, D] contiguous."""
    from ..fp8 import to_e4m3
    from .fp8_attention import root_scale

    sq, sk, _, sv = scales
    c = root_scale(q.shape[-1])
    b, _, h, d = q.shape

    def fold(x, scale, factor=1.0):  # [B, S, H, D] -> [S, B*H, D] codes (B = 1: no copy, the transpose is a view)
        return to_e4m3(x.float() * factor, scale).transpose(0, 1).contiguous().view(x.shape[1], b * h, d)
    return fold(q, sq, c), fold(k, sk, c), fold(v, sv)


def run(q8, k8, v8, scales):
    """The kernel on operands(...)'s codes with the recipe's (sq, sk, sp, sv): [S_q, B*H, D] bf16."""
    sq, sk, _, sv = (float(x) for x in scales)
    return fa3_fp8_attention(q8, k8, v8, [sq, sk, sv])


def attention(q, k, v, scales):
    """fp8-attn's attention through FlashInfer: q, k, v [B, S, H, D] (after RoPE, as diffusers' processor holds them),
    scales (sq, sk, sp, sv) -> [B, S, H, D] in q's dtype."""
    b, s, h, d = q.shape
    return run(*operands(q, k, v, scales), scales).view(s, b, h, d).transpose(0, 1).to(q.dtype)
