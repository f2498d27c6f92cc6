"""Our BERT encoder against transformers' (fp32): hidden states, sentence-transformers embeddings
(modules.json + 1_Pooling + Normalize honoured) and cross-encoder logits."""
from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
import transformers

from asyncengine.errors import ModelLoadError
from asyncengine.layers import packed_linear
from asyncengine.layers.pooler import PoolingSpec
from asyncengine.models.bert import classify_token_ids, embed_token_ids, load_bert, rerank_scores
from asyncengine.models.st_pooling import read_st_pooling
from model_utils import make_tiny_bert, write_st_pooling

TEXTS = ["the cat sat on the mat", "a dog", "the sky is blue and big", "cat", "far far ran the dog"]
_tiny_bert, _st_files = make_tiny_bert, write_st_pooling  # tests/model_utils.py


def test_hidden_states_match_transformers_on_a_packed_batch(tmp_path):
    ref = _tiny_bert(tmp_path)
    ours = load_bert(tmp_path)
    rng = random.Random(0)
    seqs = [[rng.randrange(5, 18) for _ in range(n)] for n in (3, 9, 1, 6)]
    qsl = torch.tensor([0, 3, 12, 13, 19])
    with torch.no_grad():
        got = ours(torch.tensor(sum(seqs, [])), qsl)
        for i, s in enumerate(seqs):
            want = ref(input_ids=torch.tensor([s])).last_hidden_state[0]
            torch.testing.assert_close(got[qsl[i]:qsl[i + 1]], want, rtol=1e-4, atol=1e-5)
        assert all(layer.packed is not None for layer in ours.encoder.layer) == packed_linear.available()
        for layer in ours.encoder.layer:  # F.linear with q/k/v fused (no oneDNN) gives the same
            layer.packed = None
        torch.testing.assert_close(ours(torch.tensor(sum(seqs, [])), qsl), got, rtol=1e-5, atol=1e-6)
        for layer in ours.encoder.layer:  # and the unfused q/k/v path (a hand-built model)
            layer.qkv = None
        torch.testing.assert_close(ours(torch.tensor(sum(seqs, [])), qsl), got, rtol=1e-5, atol=1e-6)


def test_packed_gemms_pad_rows_to_a_bucket_and_match_the_exact_batch(tmp_path):
    """A batch of 41 tokens runs its packed GEMMs on a bucket of 42 rows (one pad row that no
    token attends); its hidden states equal those of transformers per sequence."""
    ref = _tiny_bert(tmp_path)
    ours = load_bert(tmp_path)
    assert (ours.encoder.layer[0].packed is not None) == packed_linear.available()
    rng = random.Random(1)
    seqs = [[rng.randrange(5, 18) for _ in range(n)] for n in (17, 24)]
    assert packed_linear.bucket_rows(41) == 42
    with torch.no_grad():
        got = ours(torch.tensor(sum(seqs, [])), torch.tensor([0, 17, 41]))
        assert got.shape[0] == 41
        for s, part in zip(seqs, got.split([17, 24])):
            want = ref(input_ids=torch.tensor([s])).last_hidden_state[0]
            torch.testing.assert_close(part, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False), ("last", True)])
def test_embeddings_match_sentence_transformers(tmp_path, pooling, normalize):
    st = pytest.importorskip("sentence_transformers")
    _tiny_bert(tmp_path)
    _st_files(tmp_path, pooling, normalize)
    spec = read_st_pooling(tmp_path)
    assert spec == PoolingSpec(pooling, normalize)
    want = torch.as_tensor(st.SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    got = embed_token_ids(load_bert(tmp_path), [tok(t)["input_ids"] for t in TEXTS], [spec] * len(TEXTS))
    for g, w in zip(got, want):
        assert F.cosine_similarity(g, w.float(), dim=0) > 0.99999
        torch.testing.assert_close(g, w.float(), rtol=1e-4, atol=1e-5)


def test_rerank_logits_match_transformers_cross_encoder(tmp_path):
    ref = _tiny_bert(tmp_path, "BertForSequenceClassification")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    pairs = [("the cat", "the cat sat on the mat"), ("blue sky", "a dog ran far"), ("dog", "dog")]
    enc = [tok(q, d) for q, d in pairs]
    got = classify_token_ids(load_bert(tmp_path), [e["input_ids"] for e in enc], [e["token_type_ids"] for e in enc])
    with torch.no_grad():
        for g, e in zip(got, enc):
            want = ref(input_ids=torch.tensor([e["input_ids"]]), token_type_ids=torch.tensor([e["token_type_ids"]])).logits[0]
            torch.testing.assert_close(g, want, rtol=0, atol=1e-4)


def test_rerank_scores_match_sentence_transformers_cross_encoder(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    _tiny_bert(tmp_path, "BertForSequenceClassification", seed=1)
    pairs = [("the cat", "the cat sat on the mat"), ("blue sky", "a dog ran far"), ("dog", "big dog")]
    want = torch.as_tensor(st.CrossEncoder(str(tmp_path), device="cpu").predict(pairs)).float()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    enc = [tok(q, d) for q, d in pairs]
    got = rerank_scores(load_bert(tmp_path), [e["input_ids"] for e in enc], [e["token_type_ids"] for e in enc])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_checkpoint_that_does_not_fit_is_refused(tmp_path):
    _tiny_bert(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="does not fit BertModel"):
        load_bert(tmp_path)
