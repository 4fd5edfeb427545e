"""Prompts to the transformer's conditioning: tokenized as diffusers does (CLIP 77, T5 to the model's length;
truncation said once), encoded by the pipeline's clip and t5 executors, each distinct prompt once per run."""

from __future__ import annotations

import logging

from ..records import ManifestError

log = logging.getLogger("fluxtrt")


class PromptEncoder:
    def __init__(self, assets, geo, executors: dict):
        self.assets, self.geo, self.executors = assets, geo, executors
        self._tokenizers = None
        self._embeds: dict[str, tuple] = {}  # prompt -> (pooled [D], t5 [T, D']) reused within a run

    def tokenizers(self):
        if self._tokenizers is None:
            from transformers import AutoTokenizer

            a = self.assets
            try:  # files of an engine folder or model folder: untrusted
                self._tokenizers = (AutoTokenizer.from_pretrained(a / "tokenizer", local_files_only=True),
                                    AutoTokenizer.from_pretrained(a / "tokenizer_2", local_files_only=True))
            except Exception as e:  # noqa: BLE001 - any loader failure on a damaged file is one line
                raise ManifestError(f"cannot load the tokenizers in {a} ({type(e).__name__}); rebuild with `fluxtrt "
                                    "build` or fix the model folder") from None
        return self._tokenizers

    def _tokenize(self, tokenizer, prompts: list[str], length: int, label: str):
        ids = tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids
        full = tokenizer(prompts, padding="longest", return_tensors="pt").input_ids
        if full.shape[-1] > length:
            dropped = max(len(tokenizer.decode(row[length - 1:-1], skip_special_tokens=True).split()) for row in full)
            log.warning("prompt truncated to %d %s tokens (it has %d; about %d words dropped)", length, label,
                        full.shape[-1], dropped)
        return ids

    def forget(self) -> None:
        """Drop the prompt embeddings kept for reuse within a run (bench times the encoders every run)."""
        self._embeds.clear()

    def encode(self, prompts: list[str]):
        """(pooled [B, D], t5 [B, T, D']) as float32 on the executor device; each distinct prompt encoded once."""
        import torch

        new = [p for p in dict.fromkeys(prompts) if p not in self._embeds]
        if new:
            clip_tok, t5_tok = self.tokenizers()
            clip_ids = self._tokenize(clip_tok, new, self.geo.clip_length, "CLIP")
            t5_ids = self._tokenize(t5_tok, new, self.geo.t5_length, "T5")
            pooled = self.executors["clip"].infer({"input_ids": clip_ids})["pooled_embeds"].float()
            text = self.executors["t5"].infer({"input_ids": t5_ids})["text_embeds"].float()
            for i, p in enumerate(new):
                self._embeds[p] = (pooled[i].clone(), text[i].clone())
        pooled = torch.stack([self._embeds[p][0] for p in prompts])
        text = torch.stack([self._embeds[p][1] for p in prompts])
        return pooled, text
