"""Train the tiny models' tokenizers on fluxtrt/data/prompts.txt and store them in fluxtrt/data/tokenizers/.

A small BPE for CLIP and a small unigram model for T5, in the formats of the real FLUX.1 tokenizers.
The trainers are not deterministic across processes (hash-map tie-breaking in the `tokenizers` crate),
so the result is trained once, offline, and shipped: the tiny models are then byte-identical everywhere.
Run: python scripts/train_tiny_tokenizers.py
"""

from pathlib import Path

from transformers import CLIPTokenizer, T5Tokenizer

DATA = Path(__file__).resolve().parents[1] / "fluxtrt" / "data"


def main():
    corpus = [s.strip() for s in (DATA / "prompts.txt").read_text().splitlines() if s.strip()]
    clip = CLIPTokenizer().train_new_from_iterator(corpus, vocab_size=512, show_progress=False)
    clip.model_max_length = 77
    t5 = T5Tokenizer().train_new_from_iterator(corpus, vocab_size=400, show_progress=False)
    t5.model_max_length = 512
    clip.save_pretrained(DATA / "tokenizers" / "clip")
    t5.save_pretrained(DATA / "tokenizers" / "t5")
    print(f"clip: {len(clip)} tokens, t5: {len(t5)} tokens -> {DATA / 'tokenizers'}")


if __name__ == "__main__":
    main()
