"""Sampler: exact distributions (chi-square), greedy, seeds, processors, penalties, logprobs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncengine.worker.sampler import Sampler, gather_logprobs, process_logits
from asyncengine.worker.sampling_metadata import SamplingMetadata, seeded_uniform, validate_token_ids
from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import SamplingParams, resolve_unset

scipy_stats = pytest.importorskip("scipy.stats")

CPU = torch.device("cpu")
# the sampler's tests are written against vLLM's neutral field values (temperature 1, no filter,
# no penalty), not the engine's chat defaults (sampling_params.ENGINE_DEFAULTS)
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 16}


def SP(**kw) -> SamplingParams:
    """SamplingParams with the fields not given at NEUTRAL (as the front end would fill them)."""
    return resolve_unset(SamplingParams(**kw), NEUTRAL)
EOS = [0]


def build(params, logits_rows=None, prompts=None, outputs=None, eos=EOS, bad_words=None, V=None,
          generator=None):
    B = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[1, 2, 3]] * B,
        outputs if outputs is not None else [[]] * B,
        eos, bad_words, V, CPU, generator)


def sample(logits, params, **kw):
    meta = build(params, V=logits.shape[-1], **kw)
    return Sampler()(logits, meta), meta


# ---------------------------------------------------------------------------------------------
# numpy float64 reference of the filtering pipeline (vLLM semantics)

def ref_distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Exact sampling distribution of one row, from its processed logits."""
    x = np.asarray(logits, dtype=np.float64).copy()
    V = x.shape[0]
    if p.temperature < 1e-5:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out
    x = x / p.temperature
    if p.min_p > 0:
        x[x < x.max() + math.log(p.min_p)] = -np.inf
    if 0 < p.top_k < V:
        thresh = np.sort(x)[::-1][p.top_k - 1]
        x[x < thresh] = -np.inf
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sp = probs[order]
        above = np.cumsum(sp) - sp
        drop = order[above >= p.top_p]
        probs[drop] = 0.0
        probs /= probs.sum()
    return probs


def chi2_check(samples: list[int], expected: np.ndarray, alpha: float = 1e-4) -> None:
    n = len(samples)
    counts = np.bincount(np.asarray(samples), minlength=len(expected)).astype(np.float64)
    assert counts[expected == 0].sum() == 0, f"sampled a filtered token: {np.nonzero(counts * (expected == 0))}"
    exp = expected * n
    keep = exp >= 5
    obs_k, exp_k = list(counts[keep]), list(exp[keep])
    small = (~keep) & (expected > 0)
    if small.any():  # pool rare categories into one bin
        obs_k.append(counts[small].sum())
        exp_k.append(exp[small].sum())
    if len(obs_k) < 2:
        assert counts.sum() == n
        return
    stat, pval = scipy_stats.chisquare(obs_k, exp_k)
    assert pval > alpha, f"chi-square p={pval:.2e}\nobserved={counts}\nexpected={exp}"


# not sorted: the candidate paths must map back to token ids
BASE_LOGITS = torch.tensor([0.3, -1.0, 1.5, -4.0, 1.0, 2.0, -0.4, 0.7, -2.5, 1.2, 0.0, -1.5])
N_DRAWS = 20000


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.7),
    dict(temperature=1.0, top_k=3),
    dict(temperature=0.8, top_p=0.7),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.0, min_p=0.15),
    dict(temperature=1.3, top_k=6, top_p=0.8, min_p=0.05),
    dict(temperature=0.9, top_k=5, min_p=0.3),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_distribution_matches_reference(kw):
    p = SP(**kw)
    logits = BASE_LOGITS.repeat(N_DRAWS, 1)
    gen = torch.Generator().manual_seed(1234)
    out, _ = sample(logits, [p] * N_DRAWS, generator=gen)
    chi2_check(out.sampled_token_ids, ref_distribution(BASE_LOGITS.numpy(), p))


def test_distribution_with_penalties_bias_and_masks():
    V = len(BASE_LOGITS)
    prompt = [1, 3, 3, 8]
    output = [2, 2, 2, 5, 9]
    p = SP(temperature=1.1, repetition_penalty=1.4, presence_penalty=0.4,
                       frequency_penalty=0.25, logit_bias={4: 1.5, 6: -0.5})
    logits = BASE_LOGITS.repeat(N_DRAWS, 1)
    gen = torch.Generator().manual_seed(99)
    out, _ = sample(logits, [p] * N_DRAWS, prompts=[prompt] * N_DRAWS,
                    outputs=[output] * N_DRAWS, generator=gen)
    # processed logits by hand
    x = BASE_LOGITS.double().numpy().copy()
    x[4] += 1.5
    x[6] -= 0.5
    for t in set(prompt + output):
        x[t] = x[t] / 1.4 if x[t] > 0 else x[t] * 1.4
    counts = np.bincount(output, minlength=V)
    x -= 0.25 * counts + 0.4 * (counts > 0)
    chi2_check(out.sampled_token_ids, ref_distribution(x, p))


def test_distribution_top_p_flat_rows_full_vocab_fallback():
    """Rows whose top-256 candidates hold less than top_p: redone on the whole vocabulary."""
    V = 300
    g = torch.Generator().manual_seed(0)
    flat = torch.rand(V, generator=g) * 0.3  # nearly uniform: 256 candidates < 0.9 of the mass
    peaked = torch.randn(V, generator=g) * 3.0
    p = SP(temperature=1.0, top_p=0.9)
    n = 8000
    logits = torch.cat([flat.repeat(n, 1), peaked.repeat(n, 1)])
    out, _ = sample(logits, [p] * (2 * n), generator=torch.Generator().manual_seed(5))
    chi2_check(out.sampled_token_ids[:n], ref_distribution(flat.numpy(), p))
    chi2_check(out.sampled_token_ids[n:], ref_distribution(peaked.numpy(), p))


def test_distribution_mixed_batch_paths():
    """A top-k row batched with a row without top-k (general path) keeps its distribution."""
    pk = SP(temperature=0.9, top_k=4)
    pt = SP(temperature=0.9)
    n = N_DRAWS // 2
    logits = BASE_LOGITS.repeat(2 * n, 1)
    out, _ = sample(logits, [pk, pt] * n, generator=torch.Generator().manual_seed(7))
    chi2_check(out.sampled_token_ids[0::2], ref_distribution(BASE_LOGITS.numpy(), pk))
    chi2_check(out.sampled_token_ids[1::2], ref_distribution(BASE_LOGITS.numpy(), pt))


def test_seeded_requests_distribution():
    """Seeded draws (one per seed) follow the distribution too."""
    p_list = [SP(temperature=1.0, top_k=8, seed=s) for s in range(N_DRAWS)]
    out, _ = sample(BASE_LOGITS.repeat(N_DRAWS, 1), p_list)
    chi2_check(out.sampled_token_ids, ref_distribution(BASE_LOGITS.numpy(), p_list[0]))


def test_seeded_uniform_is_uniform():
    u = np.array([seeded_uniform(7, pos) for pos in range(20000)])
    assert ((0 <= u) & (u < 1)).all()
    stat, pval = scipy_stats.kstest(u, "uniform")
    assert pval > 1e-4


# ---------------------------------------------------------------------------------------------
# greedy

def test_greedy_is_argmax_fast_path():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 1000, generator=g)
    params = [SP(temperature=0.0)] * 64
    meta = build(params, V=1000)
    assert meta.fast_greedy
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_greedy_rows_in_mixed_batch_use_processed_logits():
    g = torch.Generator().manual_seed(4)
    V = 500
    logits = torch.randn(16, V, generator=g)
    outputs = [[int(logits[i].argmax())] for i in range(16)]  # the argmax was already generated
    params = [SP(temperature=0.0 if i % 2 == 0 else 1.0, repetition_penalty=5.0,
                             top_k=5 if i % 4 == 1 else 0) for i in range(16)]
    out, meta = sample(logits.clone(), params, outputs=outputs, prompts=[[]] * 16)
    assert not meta.fast_greedy
    x = logits.clone()
    for i in range(16):
        t = outputs[i][0]
        x[i, t] = x[i, t] / 5.0 if x[i, t] > 0 else x[i, t] * 5.0
    for i in range(0, 16, 2):
        assert out.sampled_token_ids[i] == int(x[i].argmax())
        assert out.sampled_token_ids[i] != outputs[i][0]


def test_input_not_modified_and_bf16_and_padded_vocab():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 130, generator=g).to(torch.bfloat16)
    before = logits.clone()
    params = [SP(temperature=0.0, logit_bias={7: 100.0})] * 4
    out, _ = sample(logits, params)  # V = 130
    assert torch.equal(logits, before)
    assert out.sampled_token_ids == [7] * 4
    # padded vocabulary: columns beyond vocab_size are never chosen
    logits = torch.zeros(3, 140)
    logits[:, 130:] = 50.0
    meta = build([SP(temperature=0.0)] * 3, V=130)
    assert all(t < 130 for t in Sampler()(logits, meta).sampled_token_ids)
    meta = build([SP(temperature=1.0)] * 3, V=130)
    assert all(t < 130 for t in Sampler()(logits, meta).sampled_token_ids)


# ---------------------------------------------------------------------------------------------
# seeds

def _fake_model_logits(context: list[int], V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(tuple(context)) & 0xFFFFFFFF)
    return torch.randn(V, generator=g) * 2.0


def _generate(batch_specs, steps: int, V: int = 300, gen_seed: int = 0):
    """Run a toy decoding loop; batch_specs: list of SamplingParams (one row each).
    Returns the generated tokens per row."""
    prompts = [[1, 2, 3, i] for i in range(len(batch_specs))]
    outputs: list[list[int]] = [[] for _ in batch_specs]
    sampler = Sampler()
    gen = torch.Generator().manual_seed(gen_seed)
    for _ in range(steps):
        logits = torch.stack([_fake_model_logits(pr + o, V) for pr, o in zip(prompts, outputs)])
        meta = SamplingMetadata.build(batch_specs, prompts, outputs, EOS, None, V, CPU, gen)
        out = sampler(logits, meta)
        for o, t in zip(outputs, out.sampled_token_ids):
            o.append(t)
    return prompts, outputs


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=20),
                                dict(temperature=1.2, top_p=0.9), dict(min_p=0.05)])
def test_seed_independent_of_batch_and_slot(kw):
    V = 300
    target = SP(seed=1234, **kw)
    steps = 12

    def run(batch, slot, gen_seed):
        specs = list(batch)
        specs.insert(slot, target)
        # the target row must see the same prompt whatever its slot
        prompts = [[9, 9, 9]] + [[1, 2, 3, i] for i in range(len(batch))]
        prompts = prompts[1:slot + 1] + [prompts[0]] + prompts[slot + 1:]
        outputs: list[list[int]] = [[] for _ in specs]
        sampler = Sampler()
        gen = torch.Generator().manual_seed(gen_seed)
        for _ in range(steps):
            logits = torch.stack([_fake_model_logits(pr + o, V) for pr, o in zip(prompts, outputs)])
            meta = SamplingMetadata.build(specs, prompts, outputs, EOS, None, V, CPU, gen)
            for o, t in zip(outputs, sampler(logits, meta).sampled_token_ids):
                o.append(t)
        return outputs[slot]

    alone = run([], 0, 0)
    others = [SP(temperature=0.0), SP(temperature=1.0),
              SP(temperature=0.7, top_p=0.5, seed=5), SP(top_k=3),
              SP(temperature=1.0, logprobs=3, repetition_penalty=1.2)]
    assert run(others, 2, 1) == alone
    assert run(others[::-1], 5, 2) == alone
    assert run(others[:1], 1, 3) == alone
    # a different seed gives a different sequence
    other = SP(seed=4321, **kw)
    _, outs = _generate([other], steps, V)
    assert outs[0] != alone


def test_unseeded_rows_follow_generator():
    params = [SP(temperature=1.0)] * 8
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0))
    a = Sampler()(logits, build(params, V=300, generator=torch.Generator().manual_seed(11)))
    b = Sampler()(logits, build(params, V=300, generator=torch.Generator().manual_seed(11)))
    c = Sampler()(logits, build(params, V=300, generator=torch.Generator().manual_seed(12)))
    assert a.sampled_token_ids == b.sampled_token_ids
    assert a.sampled_token_ids != c.sampled_token_ids


# ---------------------------------------------------------------------------------------------
# processors and penalties

def _processed(logits, params, **kw):
    meta = build(params, V=logits.shape[-1], **kw)
    return process_logits(logits.clone().float(), meta)


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(6)
    V = 50
    logits = torch.randn(3, V, generator=g) * 3
    prompts = [[1, 2, 3, 3, 40], [5, 6], [7]]
    outputs = [[2, 10, 10, 11], [], [0, 49, 7]]
    for penalty in (1.3, 0.7):
        params = [SP(repetition_penalty=penalty)] * 3
        got = _processed(logits, params, prompts=prompts, outputs=outputs)
        for i in range(3):
            ids = torch.tensor([prompts[i] + outputs[i]])
            want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i:i + 1].clone())
            torch.testing.assert_close(got[i:i + 1], want)


def test_presence_frequency_penalties_openai_formula():
    g = torch.Generator().manual_seed(7)
    V = 40
    logits = torch.randn(2, V, generator=g)
    prompts = [[1, 1, 1, 2], [3]]  # prompt tokens are NOT penalized by presence/frequency
    outputs = [[5, 5, 5, 7, 9, 9], [3, 3]]
    params = [SP(presence_penalty=0.6, frequency_penalty=0.35),
              SP(presence_penalty=-0.5, frequency_penalty=1.1)]
    got = _processed(logits, params, prompts=prompts, outputs=outputs)
    for i, p in enumerate(params):
        counts = torch.bincount(torch.tensor(outputs[i]), minlength=V).float()
        want = logits[i] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(got[i], want)


def test_all_penalties_compose():
    g = torch.Generator().manual_seed(8)
    V = 30
    logits = torch.randn(1, V, generator=g) * 2
    prompt, output = [1, 2, 4], [4, 4, 6]
    p = SP(repetition_penalty=1.5, presence_penalty=0.2, frequency_penalty=0.1)
    got = _processed(logits, [p], prompts=[prompt], outputs=[output])[0]
    want = logits[0].clone()
    for t in set(prompt + output):
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    counts = torch.bincount(torch.tensor(output), minlength=V).float()
    want -= 0.1 * counts + 0.2 * (counts > 0).float()
    torch.testing.assert_close(got, want)


def test_logit_bias_allowed_bad_words_min_tokens():
    V = 20
    logits = torch.zeros(5, V)
    logits[:, 3] = 5.0
    params = [
        SP(temperature=0.0, logit_bias={11: 10.0, 3: -1.0, 999: 5.0}),
        SP(temperature=0.0, allowed_token_ids=[4, 9, 12]),
        SP(temperature=0.0),  # bad words: [3] (always), [7, 8] (after 7)
        SP(temperature=0.0, min_tokens=3, stop_token_ids=[17]),
        SP(temperature=0.0, min_tokens=2, stop_token_ids=[17]),
    ]
    logits[1, 9] = 1.0
    logits[2, 8] = 4.0
    logits[3, 0] = 9.0  # EOS
    logits[3, 17] = 8.0
    logits[4, 0] = 9.0
    outputs = [[], [], [1, 7], [5, 5], [5, 5]]
    bad = [None, None, [[3], [7, 8], [2, 8]], None, None]
    got = _processed(logits, params, outputs=outputs, bad_words=bad)
    assert got[0, 11] == 10.0 and got[0, 3] == 4.0
    allowed = torch.full((V,), float("-inf"))
    allowed[[4, 9, 12]] = logits[1, [4, 9, 12]]
    assert torch.equal(got[1], allowed)
    assert got[2, 3] == float("-inf") and got[2, 8] == float("-inf")  # prefix [7] matched
    assert got[3, 0] == float("-inf") and got[3, 17] == float("-inf")  # 2 < min_tokens=3
    assert got[4, 0] == 9.0 and got[4, 17] == 0.0  # min_tokens reached

    out, _ = sample(logits, params, outputs=outputs, bad_words=bad)
    assert out.sampled_token_ids[0] == 11
    assert out.sampled_token_ids[1] == 9
    assert out.sampled_token_ids[2] not in (3, 8)
    assert out.sampled_token_ids[3] == 3
    assert out.sampled_token_ids[4] == 0
    # the bad word [7, 8] is not banned when the output does not end with 7
    got = _processed(logits[2:3], params[2:3], outputs=[[7, 1]], bad_words=bad[2:3])
    assert got[0, 8] == 4.0


def test_min_tokens_ignores_ignore_eos_and_random_rows_respect_bans():
    V = 10
    logits = torch.zeros(4000, V)
    logits[:, 0] = 3.0  # EOS very likely
    p = SP(temperature=1.0, min_tokens=5, ignore_eos=True)
    out, _ = sample(logits, [p] * 4000, outputs=[[1, 2]] * 4000,
                    generator=torch.Generator().manual_seed(1))
    assert 0 not in out.sampled_token_ids
    p = SP(temperature=1.0, allowed_token_ids=[2, 5])
    out, _ = sample(logits, [p] * 4000, generator=torch.Generator().manual_seed(1))
    assert set(out.sampled_token_ids) == {2, 5}


def test_validate_token_ids():
    validate_token_ids(SP(logit_bias={3: 1.0}, allowed_token_ids=[1]), 10)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        validate_token_ids(SP(logit_bias={10: 1.0}), 10)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        validate_token_ids(SP(allowed_token_ids=[-1]), 10)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        validate_token_ids(SP(stop_token_ids=[12]), 10)


# ---------------------------------------------------------------------------------------------
# logprobs

def test_logprobs_are_raw_log_softmax():
    g = torch.Generator().manual_seed(9)
    V = 64
    logits = torch.randn(5, V, generator=g) * 2
    params = [
        SP(temperature=0.5, top_k=3, logprobs=4, repetition_penalty=2.0),
        SP(temperature=0.0),
        SP(temperature=0.0, logprobs=0, logit_bias={1: 50.0}),
        SP(temperature=1.3, top_p=0.5, logprobs=2, seed=3),
        SP(temperature=1.0, logprobs=V + 10),
    ]
    out, _ = sample(logits, params, outputs=[[1, 2]] * 5,
                    generator=torch.Generator().manual_seed(0))
    lp = out.logprobs
    raw = logits.log_softmax(-1)
    assert lp.logprob_token_ids[1] is None and lp.logprobs[1] is None
    assert lp.sampled_token_ranks[1] is None
    for i, k in [(0, 4), (2, 0), (3, 2), (4, V)]:
        ids, lps, rank = lp.logprob_token_ids[i], lp.logprobs[i], lp.sampled_token_ranks[i]
        assert len(ids) == len(lps) == k + 1
        tok = out.sampled_token_ids[i]
        assert ids[0] == tok
        torch.testing.assert_close(torch.tensor(lps), raw[i, ids])
        top = raw[i].topk(k).indices.tolist() if k else []
        assert ids[1:] == top
        assert rank == int((raw[i] >= raw[i, tok]).sum())
    assert out.sampled_token_ids[2] == 1


@pytest.mark.parametrize("all_rows", [True, False])
def test_logprobs_come_after_the_ids_and_stay_raw_when_the_logits_are_handed_over(all_rows):
    """owned=True processes the caller's logits in place; the logprobs, read afterwards (after
    the ids were handed on), are still the raw ones; a step where nobody asked has none."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 40, generator=g) * 2
    params = [SP(temperature=0.0, logprobs=3, presence_penalty=1.5, logit_bias={7: 9.0}),
              SP(temperature=0.0, logprobs=None if not all_rows else 1, logit_bias={5: 30.0}),
              SP(temperature=0.7, top_k=4, logprobs=2, seed=11)]
    raw = logits.log_softmax(-1)
    handed = logits.clone()
    out = Sampler()(handed, build(params, outputs=[[3, 3]] * 3, V=40), owned=True)
    assert not torch.equal(handed, logits)  # processed in place: no private copy
    assert out.sampled_token_ids[1] == 5
    lp = out.logprobs
    for i in (0, 2):
        torch.testing.assert_close(torch.tensor(lp.logprobs[i]), raw[i, lp.logprob_token_ids[i]])
        assert lp.logprob_token_ids[i][0] == out.sampled_token_ids[i]
    assert (lp.logprobs[1] is None) != all_rows
    plain = Sampler()(logits, build([SP(temperature=0.0, logit_bias={2: 1.0})] * 3, V=40))
    assert plain.logprobs is None


def test_gather_logprobs_prompt_style():
    lp = torch.tensor([[0.0, -1.0, -2.0], [-3.0, -0.5, -0.25]])
    ids, vals, ranks = gather_logprobs(lp, torch.tensor([2, 0]), 1)
    assert ids.tolist() == [[2, 0], [0, 2]]
    assert vals.tolist() == [[-2.0, 0.0], [-3.0, -0.25]]
    assert ranks.tolist() == [3, 3]
