"""Decoder sequence-classification models through the engine (models/seq_cls.py): a tiny
Qwen2ForSequenceClassification / LlamaForSequenceClassification (one label, a Qwen3-reranker
converted to a classifier has this shape) reranks (query, document) pairs through the scheduler,
with chunked prefill (a 16-token budget) and the prefix cache on, equal (1e-4) to transformers'
sigmoid of the last token's logit; it cannot generate; no KV block held after."""
from __future__ import annotations

import pytest
import torch
import transformers

from asyncengine import LLM, SamplingParams
from asyncengine.errors import ConfigError, InvalidRequestError
from model_utils import save_tiny_tokenizer, scale_weights

QUERY = "The quick brown fox"
DOCS = ["jumps over the lazy dog.", "Paris is the capital of France.", "def f(x):\n    return x + 1",
        "Café, naïve", "The quick brown fox jumps over the lazy dog. The quick brown fox jumps."]
CONFIGS = {"Qwen2ForSequenceClassification": transformers.Qwen2Config,
           "LlamaForSequenceClassification": transformers.LlamaConfig}


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_decoder_classifier_reranks_like_transformers(tmp_path, arch):
    cfg = CONFIGS[arch](hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, pad_token_id=2,
                        num_labels=1, architectures=[arch])
    torch.manual_seed(0)
    ref = getattr(transformers, arch)(cfg).eval()
    scale_weights(ref)
    ref.save_pretrained(tmp_path)
    save_tiny_tokenizer(str(tmp_path), 512)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    with LLM(str(tmp_path), dtype="float32", device="cpu", num_threads=1, freeze_gc_after_load=False,
             max_num_batched_tokens=16, num_kv_blocks=128, max_model_len=256) as llm:
        assert llm.supported_tasks == ("classify", "embed") and llm.default_pooling == "last"
        got = torch.tensor(llm.rerank(QUERY, DOCS))
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
        with pytest.raises(InvalidRequestError, match="cannot generate"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    with torch.no_grad():
        want = torch.stack([torch.sigmoid(ref(torch.tensor([tok(QUERY, d)["input_ids"]])).logits[0, 0])
                            for d in DOCS])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    with pytest.raises(ConfigError, match="cannot generate"):
        LLM(str(tmp_path), runner="generate", dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=64)
