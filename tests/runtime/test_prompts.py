"""runtime/prompts.py: each distinct prompt encoded once per run, in the order asked, and forgotten on request."""

import torch

from fluxtrt.runtime.assembly import open_pipeline


def test_each_distinct_prompt_is_encoded_once_and_forget_encodes_again():
    pipe = open_pipeline(None, backend="torch", model="tiny-schnell", device="cpu", torch_dtype="fp32")
    calls = []
    clip = pipe.executors["clip"]
    orig = clip.infer
    clip.infer = lambda feeds: calls.append(feeds["input_ids"].shape[0]) or orig(feeds)
    pooled, text = pipe.prompts.encode(["a fox", "a cat", "a fox"])
    assert calls == [2] and pooled.shape[0] == 3 and text.shape[:2] == (3, pipe.geo.t5_length)
    assert torch.equal(pooled[0], pooled[2]) and not torch.equal(pooled[0], pooled[1])
    again, _ = pipe.prompts.encode(["a cat"])
    assert calls == [2] and torch.equal(again[0], pooled[1])  # kept within the run
    pipe.prompts.forget()
    pipe.prompts.encode(["a cat"])
    assert calls == [2, 1]
