"""FLUX attention with the attention itself a function: `Processor` is diffusers' FluxAttnProcessor (q/k/v
projections, RMSNorm of q and k, the text stream joined in front, RoPE, the output projections) around
`fn(q, k, v)` on [B, S, H, D] tensors, so a recipe (fp8-attn: fp8.attention_recipe) or another kernel computes
the attention alone and everything else stays diffusers' code path. `use_attention` puts one processor on each
attention module of a transformer, in forward order (the order the exported graph's attentions have)."""

from __future__ import annotations


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
        hidden_states = self.fn(query, key, value).flatten(2, 3).to(query.dtype)
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


def gather_sequence(x, group, dim: int = 1):
    """Every rank's `x` of `group` joined along `dim` in rank order (the slices may differ in length: padded for
    torch.distributed's all_gather, trimmed after)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    size = torch.tensor([x.shape[dim]], device=x.device)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s) for s in sizes]
    pad = max(sizes) - x.shape[dim]
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:dim], pad, *x.shape[dim + 1:])], dim)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim)


def context_parallel(transformer, group) -> int:
    """Context parallelism on `transformer`, in place: each attention gathers every rank's keys and values along
    the sequence (gather_sequence) and computes this rank's queries against all of them, with the function it had
    (fp8-attn's, or torch's SDPA). Exact for any number of ranks and any head count: attention's softmax runs over
    the whole sequence; every other layer of FLUX acts on each token alone. Returns the modules changed."""
    def gathered(fn):
        return lambda q, k, v: fn(q, gather_sequence(k, group), gather_sequence(v, group))

    names = attention_modules(transformer)
    for name in names:
        module = transformer.get_submodule(name)
        inner = module.processor.fn if isinstance(module.processor, Processor) else sdpa
        module.set_processor(Processor(gathered(inner)))
    return len(names)
