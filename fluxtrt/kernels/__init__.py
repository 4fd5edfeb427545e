"""Our own GPU kernels (Triton), each imported only where it runs: `fp8_attention` (fp8-attn's attention on FP8
tensor cores); `cudnn_fp8_attention`, the same attention through cuDNN's FP8 flash attention (a candidate the
benchmark measures beside it); `lora_add`, a low-rank term added in place into the columns it touches (the
served LoRAs)."""
