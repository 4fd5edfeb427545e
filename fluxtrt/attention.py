"""FLUX attention with the attention itself a function: `Processor` is diffusers' FluxAttnProcessor (q/k/v
projections, RMSNorm of q and k, the text stream joined in front, RoPE, the output projections) around
`fn(q, k, v)` on [B, S, H, D] tensors, so a recipe (fp8-attn: fp8.attention_recipe) or another kernel computes
the attention alone and everything else stays diffusers' code path. A `fn` with a `single_stream(q, k, v, attn,
rotary)` attribute takes a single-stream block's q, k, v before their RMSNorm and RoPE instead (a kernel that fuses
them with its operands' quantize: fp8-attn on FlashInfer). `use_attention` puts one processor on each
attention module of a transformer, in forward order (the order the exported graph's attentions have)."""

from __future__ import annotations

import functools

from .errors import FluxtrtError

ATTENTION = ("auto", "ulysses", "gather")  # --parallel-attention: how attention sees the whole sequence
MAX_RANKS = 8  # --parallel: the most ranks one image is split over


class Processor:
    """diffusers' FluxAttnProcessor (0.42) with `fn(q, k, v) -> [B, S, H, D]` in place of its attention call."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        import torch
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections, apply_rotary_emb

        if attention_mask is not None:
            raise ValueError("FLUX attention takes no mask")
        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
        single = getattr(self.fn, "single_stream", None)  # a kernel that takes q and k before RMSNorm and RoPE
        if single is not None and attn.added_kv_proj_dim is None and image_rotary_emb is not None:
            out = single(query, key, value, attn, image_rotary_emb)
        else:
            query, key = attn.norm_q(query), attn.norm_k(key)
            if attn.added_kv_proj_dim is not None:  # a double-stream block: the text stream's q/k/v in front
                encoder_query, encoder_key, encoder_value = (t.unflatten(-1, (-1, attn.head_dim))
                                                             for t in (encoder_query, encoder_key, encoder_value))
                encoder_query, encoder_key = attn.norm_added_q(encoder_query), attn.norm_added_k(encoder_key)
                query, key, value = (torch.cat([e, x], dim=1) for e, x in
                                     ((encoder_query, query), (encoder_key, key), (encoder_value, value)))
            if image_rotary_emb is not None:
                query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
            out = self.fn(query, key, value)
        hidden_states = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return hidden_states
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        return hidden_states, attn.to_add_out(encoder_hidden_states.contiguous())


def attention_modules(transformer) -> list[str]:
    """The transformer's attention modules in forward order: the double-stream blocks', then the single-stream
    blocks' (FluxTransformer2DModel.forward runs them so)."""
    return ([f"transformer_blocks.{i}.attn" for i in range(len(transformer.transformer_blocks))]
            + [f"single_transformer_blocks.{i}.attn" for i in range(len(transformer.single_transformer_blocks))])


def use_attention(transformer, fns: list) -> int:
    """Give each attention module of `transformer` (in forward order) its function fns[i] (q, k, v [B, S, H, D] ->
    [B, S, H, D]); ValueError when the counts differ. Returns the number of modules changed."""
    names = attention_modules(transformer)
    if len(names) != len(fns):
        raise ValueError(f"{len(fns)} attention functions for {len(names)} attention modules")
    for name, fn in zip(names, fns):
        transformer.get_submodule(name).set_processor(Processor(fn))
    return len(names)


def sdpa(query, key, value):
    """The attention diffusers' default processor computes (torch's scaled_dot_product_attention), [B, S, H, D]."""
    import torch

    out = torch.nn.functional.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                                           value.transpose(1, 2))
    return out.transpose(1, 2)


def _sizes(length: int, group, device) -> list[int]:
    """Every rank's `length` of `group`, in rank order."""
    import torch
    import torch.distributed as dist

    size = torch.tensor([length], device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    return [int(s) for s in sizes]


def gather_sequence(x, group, dim: int = 1, sizes: list | None = None):
    """Every rank's `x` of `group` joined along `dim` in rank order (the slices may differ in length: padded for
    torch.distributed's all_gather, trimmed after). `sizes`: every rank's length where the caller knows them
    (None: asked of the ranks, one small collective more)."""
    import torch
    import torch.distributed as dist

    sizes = sizes or _sizes(x.shape[dim], group, x.device)
    pad = max(sizes) - x.shape[dim]
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:dim], pad, *x.shape[dim + 1:])], dim)
    parts = [torch.empty_like(x) for _ in range(len(sizes))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim)


def ulysses(fn, group, sizes=None):
    """`fn`'s attention over the whole sequence by Ulysses' all-to-all: each rank's token slice of q, k, v
    [B, s_r, H, D] becomes every rank's tokens of its H/n heads [B, S, H/n, D], `fn` runs on those, and the
    output goes back to token slices of all heads. The heads must divide by the ranks (parallel.attention_mode).
    `sizes()`: every rank's sequence length in this call (None: asked of the ranks each time)."""
    import torch
    import torch.distributed as dist

    def attend(q, k, v):
        sizes_now = sizes() if sizes is not None else _sizes(q.shape[1], group, q.device)
        n, mine = len(sizes_now), q.shape[1]
        b, heads, d = q.shape[0], q.shape[2] // n, q.shape[3]

        def exchange(flat, send: list, receive: list):  # all_to_all_single: gloo takes unequal pieces only so
            out = flat.new_empty(sum(receive))
            dist.all_to_all_single(out, flat, output_split_sizes=receive, input_split_sizes=send, group=group)
            return out

        def to_heads(t):  # [B, s_r, H, D] -> [B, S, H/n, D]: head chunk j to rank j, every rank's tokens back
            flat = t.reshape(b, mine, n, heads, d).permute(2, 0, 1, 3, 4).reshape(-1)
            got = exchange(flat, [b * mine * heads * d] * n, [b * s * heads * d for s in sizes_now])
            return torch.cat([p.view(b, s, heads, d) for p, s in
                              zip(got.split([b * s * heads * d for s in sizes_now]), sizes_now)], dim=1)

        out = fn(to_heads(q), to_heads(k), to_heads(v))
        flat = torch.cat([o.reshape(-1) for o in out.split(sizes_now, dim=1)])
        got = exchange(flat, [b * s * heads * d for s in sizes_now], [b * mine * heads * d] * n)
        return got.view(n, b, mine, heads, d).permute(1, 2, 0, 3, 4).reshape(b, mine, n * heads, d)

    return attend


def context_parallel_fn(fn, group, mode: str, sizes=None):
    """`fn`'s attention (q, k, v: this rank's token slice) over the whole sequence of `group`'s ranks: "gather"
    (every rank's keys and values gathered, this rank's queries against all of them: any number of ranks, any
    head count) or "ulysses" (the all-to-all over heads, `ulysses`). Either is exact: the softmax runs over the
    whole sequence. `sizes()`: every rank's sequence length in the call (runtime/parallel.call_sizes: known from
    the split, so no collective asks, and a compiled module sees plain integers); None: asked of the ranks."""
    if mode == "ulysses":
        return ulysses(fn, group, sizes)
    if mode == "gather":
        def attend(q, k, v):
            known = sizes() if sizes is not None else None
            return fn(q, gather_sequence(k, group, sizes=known), gather_sequence(v, group, sizes=known))

        return attend
    raise ValueError(f"context parallel attention is ulysses or gather, got {mode!r}")


def context_parallel(transformer, group, mode: str = "gather", sizes=None) -> int:
    """Context parallelism on `transformer`, in place: each attention sees the whole sequence
    (context_parallel_fn, around the function the module had: fp8-attn's, or torch's SDPA) while every other
    layer of FLUX acts on this rank's tokens alone. Returns the modules changed."""
    names = attention_modules(transformer)
    for name in names:
        module = transformer.get_submodule(name)
        inner = module.processor.fn if isinstance(module.processor, Processor) else sdpa
        module.set_processor(Processor(context_parallel_fn(inner, group, mode, sizes)))
    return len(names)


def attention_mode(asked: str, heads: int, n: int) -> str:
    """How attention sees the whole sequence over n ranks: "ulysses" (all-to-all over heads: each rank moves
    4 x S/n x H x D per layer against gather's 2 x S x H x D, so a factor n/2 less, and keeps 1/n of the keys and
    values) where the heads divide by n; "gather" (every rank's keys and values) for any n. `asked`: auto (that
    rule), or one of the two (ulysses refused in one line where the heads do not divide)."""
    if asked not in ATTENTION:
        raise FluxtrtError(f"--parallel-attention takes {', '.join(ATTENTION)}, got {asked!r}")
    divides = heads % n == 0
    if asked == "ulysses" and not divides:
        raise FluxtrtError(f"--parallel-attention ulysses splits the {heads} attention heads over the ranks: "
                           f"{n} does not divide {heads}; use --parallel-attention gather (or auto)")
    if asked == "auto":
        return "ulysses" if divides and n > 1 else "gather"
    return asked


# --- context parallelism inside a compiled package (`fluxtrt build --backend torch --parallel N`) -------------------
# A package is compiled with each attention as one opaque op, `fluxtrt::context_attention`: Inductor compiles
# every per-token layer around it, and the op's Python body runs at call time, in the process that calls the
# package, on the rank's process group (`bind_context`, set by the runtime for its split packages): the same
# collectives as the eager path, issued in order from the calling thread.
_BOUND: dict = {}  # "group", "size", "sizes" (every rank's sequence length in the call running now, a callable)


def bind_context(group, size: int, sizes) -> None:
    """The process group of this rank's split packages (`size` ranks; `sizes()`: every rank's attention length in
    the call running now) for their `fluxtrt::context_attention` calls."""
    _BOUND.update(group=group, size=size, sizes=sizes)


def split_attention(transformer, ranks: int, mode: str) -> int:
    """Each attention of `transformer` as the op `fluxtrt::context_attention(q, k, v, ranks, mode)`, for a package
    that runs split over `ranks` ranks. Returns the modules changed."""
    op = context_attention_op()
    return use_attention(transformer, [lambda q, k, v: op(q, k, v, ranks, mode)] *
                         len(attention_modules(transformer)))


@functools.cache
def context_attention_op():
    """torch.ops.fluxtrt.context_attention, registered once per process (before a split package loads: the
    package calls it by name). Its body: `context_parallel_fn` over SDPA on the bound group (`bind_context`);
    RuntimeError where none is bound or the bound ranks differ from those the package was compiled for."""
    import torch

    @torch.library.custom_op("fluxtrt::context_attention", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v, int ranks, str mode) -> Tensor")
    def context_attention(q, k, v, ranks, mode):
        import torch.distributed as dist

        here = _BOUND.get("size", 1) if dist.is_available() and dist.is_initialized() else 1
        if here != ranks:
            raise RuntimeError(f"this package's attention is split over {ranks} ranks; this process runs {here}")
        out = context_parallel_fn(sdpa, _BOUND["group"], mode, _BOUND["sizes"])(q, k, v)
        return out.contiguous()

    @context_attention.register_fake
    def _(q, k, v, ranks, mode):
        return q.new_empty(q.shape)

    return torch.ops.fluxtrt.context_attention.default
