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
torch.compile and CUDA graphs keep it whole.

That first-use compile took about 97 s of a fresh machine's first image from fp8-attn packages (H100,
docs/bench/aot_engines.json `h100_2026_12_07_fp8attn`). So a package build ships the compiled kernel module in the
engine folder (`ship_module`: `flashinfer/<module>/<module>.so`, recorded in the recipe with its sha256 and the
flashinfer version), and the runtime loads it from there (`use_shipped`) as FlashInfer loads its own prebuilt
modules, instead of compiling."""

import logging
from pathlib import Path

import torch

MODULE_DIR = "flashinfer"  # in an engine folder: flashinfer/<module>/<module>.so, FlashInfer's prebuilt layout

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


def _module_args(head_dim: int) -> tuple:
    """The arguments single_prefill_with_kv_cache passes to get_single_prefill_module for fa3_fp8_attention's call
    (after the backend): E4M3 q and k/v, bf16 out, head dims, no positional encoding, sliding window, soft cap,
    fp16 QK reduction or token-head scales. Which kernel module the call loads is keyed on these."""
    return (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, head_dim, head_dim, 0, False, False, False,
            False)


def ship_module(folder: Path, head_dim: int) -> dict:
    """Compile (or take from FlashInfer's cache) the kernel module fa3_fp8_attention loads and copy it into the
    engine folder `folder`: the recipe's record {"file", "sha256", "flashinfer", "head_dim"}. Needs flashinfer and
    nvcc (where it is not cached yet), as the op's first call does."""
    import shutil

    import flashinfer
    from flashinfer.jit import gen_single_prefill_module

    from ..fileio import atomic_path, sha256_file

    spec = gen_single_prefill_module("fa3", *_module_args(head_dim))
    spec.build_and_load()
    rel = f"{MODULE_DIR}/{spec.name}/{spec.name}.so"
    with atomic_path(Path(folder) / rel) as tmp:
        shutil.copyfile(spec.get_library_path(), tmp)
    return {"file": rel, "sha256": sha256_file(Path(folder) / rel), "flashinfer": flashinfer.__version__,
            "head_dim": head_dim}


def shipped_file(folder: Path, record: dict, component: str) -> Path | None:
    """The kernel module ship_module's `record` names, where it is in `folder` as recorded (its sha256), else None."""
    from ..fileio import inside, sha256_file

    path = inside(Path(folder), record["file"], f"{component}.attention_module")
    return path if path.is_file() and sha256_file(path) == record["sha256"] else None


_LOADED: set[str] = set()  # the sha256 of each shipped module use_shipped has loaded in this process


def use_shipped(folder: Path, record: dict, component: str) -> bool:
    """Load the kernel module an engine folder ships (ship_module's `record`, read from its manifest) so that the
    op's first call finds it loaded instead of compiling it. A module of another flashinfer version is left alone
    (one warning line: the first call compiles as before); a file unlike its record is refused in one line.
    Returns whether it was loaded. A module loaded once stays loaded (FlashInfer caches it): later calls in the
    process, as low-VRAM runs make at every activation, neither read nor hash the file again."""
    import flashinfer
    import flashinfer.jit.env as jit_env
    from flashinfer.prefill import get_single_prefill_module

    from ..errors import ManifestError

    if record["flashinfer"] != flashinfer.__version__:
        logging.getLogger("fluxtrt").warning(
            "%s: its FlashInfer kernel module was compiled by flashinfer %s and this machine has %s: compiling it "
            "at the first call instead (minutes); build the packages here to ship this one's", component,
            record["flashinfer"], flashinfer.__version__)
        return False
    if record["sha256"] in _LOADED:
        return True
    path = shipped_file(folder, record, component)
    if path is None:
        raise ManifestError(f"{component}: {record['file']} is not the FlashInfer kernel module the manifest records "
                            "(missing, or its sha256 differs): build the packages again with `fluxtrt build --backend "
                            "torch`, or unpack the archive again")
    saved = jit_env.FLASHINFER_AOT_DIR  # where FlashInfer looks first for <module>/<module>.so, built ahead of time
    jit_env.FLASHINFER_AOT_DIR = path.parent.parent
    try:
        get_single_prefill_module("fa3", *_module_args(record["head_dim"]))  # functools.cache: the op's calls reuse it
    finally:
        jit_env.FLASHINFER_AOT_DIR = saved
    _LOADED.add(record["sha256"])
    return True


def operands(q, k, v, scales):
    """The kernel's operands from q, k, v [B, S, H, D] (after RoPE) and the recipe's (sq, sk, sp, sv): E4M3 codes
    of q*c/sq, k*c/sk and v/sv, each [S, B*H, D] contiguous."""
    from .fp8_attention import root_scale

    sq, sk, _, sv = scales
    c = root_scale(q.shape[-1])
    return fold(q, sq, c), fold(k, sk, c), fold(v, sv)


def fold(x, scale, factor=1.0):
    """[B, S, H, D] -> E4M3 codes of x * factor / scale as [S, B*H, D] (B = 1: no copy, the transpose is a view)."""
    from ..fp8 import to_e4m3

    b, s, h, d = x.shape
    return to_e4m3(x.float() * factor, scale).transpose(0, 1).contiguous().view(s, b * h, d)


def run(q8, k8, v8, scales):
    """The kernel on operands(...)'s codes with the recipe's (sq, sk, sp, sv): [S_q, B*H, D] bf16."""
    sq, sk, _, sv = (float(x) for x in scales)
    return fa3_fp8_attention(q8, k8, v8, [sq, sk, sv])


def attention(q, k, v, scales):
    """fp8-attn's attention through FlashInfer: q, k, v [B, S, H, D] (after RoPE, as diffusers' processor holds them),
    scales (sq, sk, sp, sv) -> [B, S, H, D] in q's dtype."""
    b, s, h, d = q.shape
    return run(*operands(q, k, v, scales), scales).view(s, b, h, d).transpose(0, 1).to(q.dtype)


def attention_single_stream(q, k, v, attn, rotary, *, scales):
    """attention() for a single-stream block from its projections before RMSNorm and RoPE (q, k, v [B, S, H, D],
    the block's attention module `attn` with its norm_q / norm_k, and rotary (cos, sin)): q's and k's norm, RoPE
    and E4M3 quantize as one kernel each (kernels/norm_rope_quantize.py), v's quantize as operands() does it. The
    same arithmetic as the processor's path into attention()."""
    from .fp8_attention import root_scale
    from .norm_rope_quantize import codes

    sq, sk, _, sv = scales
    b, s, h, d = q.shape
    c = root_scale(d)
    q8, k8 = codes(q, attn.norm_q, rotary, c, sq), codes(k, attn.norm_k, rotary, c, sk)
    return run(q8, k8, fold(v, sv), scales).view(s, b, h, d).transpose(0, 1).to(q.dtype)
