"""Our own GPU kernels (Triton), each imported only where it runs: `fp8_attention` (fp8-attn's attention on FP8
tensor cores)."""
