"""Each component's PyTorch module with positional inputs in its spec's order (components.py names them): what
export traces, validation compares and the torch executor runs. The transformer also as First-Block Cache's
three parts (head, tail, out: stepcache.py)."""

from __future__ import annotations


def clip(model):
    import torch

    class ClipPooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids, output_hidden_states=False).pooler_output

    return ClipPooled()


def t5(model):
    import torch

    class T5Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids, output_hidden_states=False)[0]

    return T5Hidden()


def transformer(model):
    import torch

    guided = bool(model.config.guidance_embeds)

    class FluxStep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                    guidance=None):
            return self.model(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids, txt_ids=txt_ids,
                guidance=guidance if guided else None, return_dict=False,
            )[0]

    return FluxStep()


def _transformer_prologue(m, hidden_states, timestep, pooled_projections, guidance, *, guided):
    """FluxTransformer2DModel.forward up to its blocks' inputs: (embedded hidden states, temb)."""
    x = m.x_embedder(hidden_states)
    t = timestep.to(x.dtype) * 1000
    temb = (m.time_text_embed(t, guidance.to(x.dtype) * 1000, pooled_projections) if guided
            else m.time_text_embed(t, pooled_projections))
    return x, temb


def _rotary(m, img_ids, txt_ids):
    import torch

    return m.pos_embed(torch.cat((txt_ids, img_ids), dim=0))


def transformer_head(model):
    """First-Block Cache's head (stepcache.py): the embeddings and the first block, as diffusers' forward runs
    them; returns the block's outputs, temb, and the residual the cache decides on."""
    import torch

    guided = bool(model.config.guidance_embeds)

    class FluxHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                    guidance=None):
            m = self.model
            x, temb = _transformer_prologue(m, hidden_states, timestep, pooled_projections, guidance, guided=guided)
            encoder, hidden = m.transformer_blocks[0](
                hidden_states=x, encoder_hidden_states=m.context_embedder(encoder_hidden_states), temb=temb,
                image_rotary_emb=_rotary(m, img_ids, txt_ids))
            return hidden, encoder, temb, hidden - x

    return FluxHead()


def transformer_tail(model):
    """First-Block Cache's tail: every block after the first; returns the last block's image stream."""
    import torch

    class FluxTail(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, head_hidden, head_encoder, temb, img_ids, txt_ids):
            m = self.model
            rotary = _rotary(m, img_ids, txt_ids)
            hidden, encoder = head_hidden, head_encoder
            for block in list(m.transformer_blocks)[1:] + list(m.single_transformer_blocks):
                encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                        image_rotary_emb=rotary)
            return hidden

    return FluxTail()


def transformer_out(model):
    """What runs after the blocks at every step: norm_out and proj_out."""
    import torch

    class FluxOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, hidden, temb):
            return self.model.proj_out(self.model.norm_out(hidden, temb))

    return FluxOut()


def vae_decoder(vae):
    import torch

    class VaeDecode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vae = vae

        def forward(self, latent):
            return self.vae.decode(latent, return_dict=False)[0]

    return VaeDecode()


def vae_encoder(vae):
    import torch

    class VaeEncode(torch.nn.Module):
        """Returns the latent distribution's parameters (mean and logvar stacked on channels), so the
        runtime draws the sample with its own generator exactly as diffusers does."""

        def __init__(self):
            super().__init__()
            self.vae = vae

        def forward(self, image):
            h = self.vae.encoder(image)
            if self.vae.quant_conv is not None:
                h = self.vae.quant_conv(h)
            return h

    return VaeEncode()
