"""Tiny random-weight HF checkpoints and the transformers reference, for parity tests.

Checkpoints are made with ``from_config`` + ``save_pretrained`` and loaded through our real
loader. 2-D weights are rescaled to N(0, 1/fan_in) so logits are far from uniform (the default
0.02 init makes nearly every step a near-tie)."""
from __future__ import annotations

import contextlib
import json
import random
from dataclasses import dataclass

import torch
import transformers

ARCHS = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32}),
    # Gemma: a sliding (window 16) then a global layer, each with its rope; a score scale that is not
    # head_dim ** -0.5; Gemma 2 soft-caps scores and logits (caps small enough to bite)
    "gemma3": (transformers.Gemma3TextConfig, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=16, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        layer_types=["sliding_attention", "full_attention"])),
    "gemma2": (transformers.Gemma2Config, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0, layer_types=["sliding_attention", "full_attention"])),
    # Phi-3 with Phi-4-mini's partial rotary (3/4 of each head) and LongRoPE: short factors below 128
    # positions (the parity workload's), long ones from there (test_phi3 crosses it with a smaller one)
    "phi3": (transformers.Phi3Config, dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=128, max_position_embeddings=1024,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                      "long_factor": [2.0 + 0.5 * i for i in range(6)]})),
}

# mixture-of-experts members of the Llama family (models/moe.py): 8 experts, top 2 (Qwen2-MoE with
# its gated shared expert; Qwen3-MoE renormalising its top 2, Qwen2-MoE not)
MOE_ARCHS = {
    "mixtral": (transformers.MixtralConfig, {"sliding_window": None, "num_local_experts": 8,
                                            "num_experts_per_tok": 2, "intermediate_size": 64}),
    "qwen2_moe": (transformers.Qwen2MoeConfig, {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                "shared_expert_intermediate_size": 64, "norm_topk_prob": False}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "olmoe": (transformers.OlmoeConfig, {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                                         "clip_qkv": 3.0}),
    "granitemoe": (transformers.GraniteMoeConfig, {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                                                   "embedding_multiplier": 2.0, "attention_multiplier": 0.2,
                                                   "residual_multiplier": 0.5, "logits_scaling": 2.0}),
}
ARCHS_ALL = {**ARCHS, **MOE_ARCHS}

# hybrid (Mamba2 + attention) architectures: complete tiny configs (their field names differ from
# Llama's, so none of make_tiny_checkpoint's Llama defaults apply). Every Mamba layer has 8 heads
# of 16 in 2 groups, a 16-wide state and chunks of 16 positions, so the 3-60-token prompts cross
# chunk boundaries of the scan.
_TINY_COMMON = dict(vocab_size=512, bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
HYBRID_ARCHS = {
    "mamba2": (transformers.Mamba2Config, dict(
        hidden_size=64, num_heads=8, head_dim=16, n_groups=2, state_size=16, conv_kernel=4, chunk_size=16,
        expand=2, num_hidden_layers=2)),
    "bamba": (transformers.BambaConfig, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, attn_layer_indices=[1], num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
        mamba_chunk_size=16, mamba_expand=2, max_position_embeddings=1024)),
    "nemotron_h": (transformers.NemotronHConfig, dict(
        hidden_size=64, hybrid_override_pattern="M*M-", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16,
        conv_kernel=4, max_position_embeddings=1024)),
    "granitemoehybrid": (transformers.GraniteMoeHybridConfig, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=0, shared_intermediate_size=128,
        position_embedding_type="rope", mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
        mamba_chunk_size=16, mamba_expand=2, max_position_embeddings=1024, embedding_multiplier=2.0,
        attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0)),
}
# Granite 4.0 hybrid with routed experts (8, top 2) beside its shared MLP
# Nemotron-H with an E layer: 8 plain squared-ReLU experts in 2 groups (top 1 group), top 2, sigmoid
# router with a selection bias, scaled weights, shared experts
HYBRID_ARCHS["nemotron_h_moe"] = (transformers.NemotronHConfig, {
    **HYBRID_ARCHS["nemotron_h"][1], "hybrid_override_pattern": "M*E-E", "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 64, "n_group": 2, "topk_group": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True})
HYBRID_ARCHS["granitemoehybrid_moe"] = (transformers.GraniteMoeHybridConfig, {
    **HYBRID_ARCHS["granitemoehybrid"][1], "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32})

# run through the Transformers backend (models/transformers_backend.py): complete tiny configs
TRANSFORMERS_ARCHS = {
    "olmo2": (transformers.Olmo2Config, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-6)),
    "stablelm": (transformers.StableLmConfig, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, partial_rotary_factor=0.25, use_qkv_bias=True)),
    "gpt_neox": (transformers.GPTNeoXConfig, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=1024, rotary_pct=0.25, use_parallel_residual=True)),
    "granite": (transformers.GraniteConfig, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-6, embedding_multiplier=2.0, attention_multiplier=0.2,
        residual_multiplier=0.5, logits_scaling=2.0)),
}

TIE_MARGIN = 1e-4  # a first divergence is excused only where the reference's top-2 gap is below this


def make_tiny_checkpoint(out_dir: str, arch: str = "llama", seed: int = 0, tokenizer: bool = False,
                         **overrides) -> str:
    if arch in HYBRID_ARCHS or arch in TRANSFORMERS_ARCHS:
        cls, extra = HYBRID_ARCHS.get(arch) or TRANSFORMERS_ARCHS[arch]
        kw = dict(_TINY_COMMON)
    else:
        cls, extra = ARCHS_ALL[arch]
        kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    kw.update(extra)
    kw.update(overrides)
    cfg = cls(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    scale_weights(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer:
        save_tiny_tokenizer(out_dir, kw["vocab_size"])
    return out_dir


def scale_weights(model) -> None:
    """2-D weights (but embeddings) to N(0, 1/fan_in); norms near 1, biases near 0."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in n:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
            elif p.dim() == 3 and "experts" in n:  # stacked experts [E, out, in]
                p.normal_(0, 1.0 / p.shape[2] ** 0.5)
            elif p.dim() == 1 and ("bias" in n or "norm" in n):
                p.normal_(1.0 if "norm" in n else 0.0, 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # a router's selection bias (a buffer in transformers)
                b.normal_(0.0, 0.1)


def save_tiny_tokenizer(out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = ["The quick brown fox jumps over the lazy dog. " * 3, "def f(x):\n    return x + 1\n",
            "Paris is the capital of France. Café, naïve, 東京, 😀 emoji."] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    fast.save_pretrained(out_dir)


def random_requests(n: int, vocab: int, seed: int = 0, plen=(3, 60), olen=(1, 24)):
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*plen))], rng.randint(*olen)) for _ in range(n)]


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float]  # top-2 logit gap at each generated position


def hf_greedy(model_dir: str, requests, attn_implementation: str | None = None) -> list[Reference]:
    """transformers generate(), one request at a time, greedy, fp32, EOS ignored. ``"eager"``: the
    reference's own attention math where a version's default would skip part of it (transformers
    5.17 runs Gemma 2 on sdpa, without its soft-cap; 5.24 refuses sdpa for it)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation=attn_implementation)
    model.eval()
    refs = []
    with torch.inference_mode():
        for ids, max_tokens in requests:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            toks = out.sequences[0, len(ids):].tolist()
            margins = []
            for lg in out.logits:
                top2 = torch.topk(lg[0].float(), 2).values
                margins.append(float(top2[0] - top2[1]))
            refs.append(Reference(toks, margins))
    return refs


def compare(outputs: list[list[int]], refs: list[Reference]) -> dict:
    """Token-exact, except a first divergence at a reference near-tie. Returns counts; raises on a
    real mismatch."""
    exact, excused = 0, 0
    for i, (got, ref) in enumerate(zip(outputs, refs)):
        assert len(got) == len(ref.tokens), f"request {i}: {len(got)} tokens, reference {len(ref.tokens)}"
        if got == ref.tokens:
            exact += 1
            continue
        j = next(k for k in range(len(got)) if got[k] != ref.tokens[k])
        assert ref.margins[j] < TIE_MARGIN, (
            f"request {i} diverges at token {j}: got {got[j]}, reference {ref.tokens[j]}, "
            f"reference top-2 margin {ref.margins[j]:.3g} (not a near-tie)")
        excused += 1
    return {"exact": exact, "near_tie": excused, "total": len(outputs)}


def make_core(tiny, **options):
    """An EngineCore (fp32) over the weights of the ``tiny`` fixture, with its own KV cache."""
    from asyncengine.config import EngineConfig
    from asyncengine.engine_core.core import EngineCore

    model_dir, loaded = tiny
    return EngineCore(EngineConfig(model=model_dir, dtype="float32", **options), loaded)


@contextlib.contextmanager
def model_hook(engine, hook):
    """Call ``hook(k)`` on the model thread before the k-th (0, 1, ...) forward pass of the model behind
    ``engine`` (an AsyncLLMEngine, an LLM or an EngineCore), until the block exits: raise in it to
    inject a fault into the forward, block in it to hold the engine mid-step. The one place tests
    reach the model behind an engine; it goes through ``collective_rpc`` (in-process executors only:
    the hook is a local function)."""
    from worker_hooks import hook_forward, unhook_forward

    from asyncengine.errors import EngineDeadError

    core = getattr(engine, "core", None) or getattr(engine, "engine", None) or engine
    core.collective_rpc(hook_forward, (hook,))  # through the executor, like any control message
    try:
        yield
    finally:
        with contextlib.suppress(EngineDeadError):  # a dead engine's model is gone anyway
            core.collective_rpc(unhook_forward)


LOGPROB_TOL = 1e-4  # fp32 logprobs, engine vs transformers


def ref_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row t = log_softmax of transformers' logits after ids[:t+1]."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


def check_entry(entry: dict, token: int, ref_row: torch.Tensor, k: int) -> None:
    """One position's {id: Logprob}: the chosen token's logprob and rank, and the top k."""
    assert token in entry
    lp = entry[token]
    assert abs(lp.logprob - float(ref_row[token])) < LOGPROB_TOL
    assert lp.rank == int((ref_row > ref_row[token] + LOGPROB_TOL).sum()) + 1 or \
        lp.rank == int((ref_row >= ref_row[token] - LOGPROB_TOL).sum())
    top_vals, top_ids = ref_row.topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
    others = {t: v for t, v in entry.items() if t != token or t in top_ids.tolist()}
    assert set(others) == set(top_ids.tolist()), (sorted(others), top_ids.tolist())
    for r, (t, v) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), start=1):
        assert abs(entry[t].logprob - v) < LOGPROB_TOL
        if t != token:
            assert entry[t].rank == r
    assert len(entry) <= k + 1


def assert_stages_in_order(m) -> None:
    """A request's RequestMetrics: arrival <= first scheduled <= first token <= last token <=
    finished (one monotonic clock for every process on the machine)."""
    stages = [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time]
    assert None not in stages and stages == sorted(stages), m


# ------------------------------------------------------------------ BERT encoders (models/bert*.py)

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "a", "blue", "sky", "is", "big"]


def make_tiny_bert(path, arch="BertModel", seed=0):
    """A random-weight BERT (hidden 64, 2 layers, one label when a classifier) and its WordPiece
    tokenizer saved to ``path``; the transformers model returned (the reference)."""
    torch.manual_seed(seed)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "and"] + WORDS
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizer(str(path / "vocab.txt")).save_pretrained(path)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
                                  num_labels=1, architectures=[arch])
    cls = getattr(transformers, arch)
    model = cls(cfg).eval()
    with torch.no_grad():  # N(0, 1/fan_in) so the outputs are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    model.save_pretrained(path)
    return model


def write_st_pooling(path, pooling: str, normalize: bool) -> None:
    """sentence-transformers' modules.json and 1_Pooling (+ Normalize) beside a checkpoint."""
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        mods.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir()
    (path / "modules.json").write_text(json.dumps(mods))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": pooling == "last"}))


def decode_step_runner(model, token_ids: list[int], ctx: list[int]):
    """One decode step of ``len(ctx)`` sequences straight through ``model`` (CPU attention backend,
    contexts of ``ctx`` keys filled with random K/V): returns ``(run, meta)``, where ``run()`` restores
    the same KV state and runs the step (whatever ``model.native_step`` is set to at the time)."""
    from asyncengine.attention import SeqChunk, StepBatch, get_backend

    a = model.args
    backend = get_backend("cpu", num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=a.head_dim,
                          block_size=16, num_blocks=16, dtype=torch.float32, device=torch.device("cpu"),
                          max_num_tokens=64, max_num_seqs=4, max_blocks_per_seq=4)
    torch.manual_seed(0)
    caches = backend.allocate_kv_caches(a.num_layers)
    for k, v in caches:  # a filled context to attend over
        k.normal_()
        v.normal_()
    saved = [(k.clone(), v.clone()) for k, v in caches]
    seqs = [SeqChunk(i, 1, c, [4 * i + j for j in range(4)]) for i, c in enumerate(ctx)]
    meta = backend.build_metadata(StepBatch(seqs=seqs, slot_mapping=[64 * i + c for i, c in enumerate(ctx)]))
    ids, pos = torch.tensor(token_ids), torch.tensor(ctx)

    def run() -> torch.Tensor:
        for (k, v), (k0, v0) in zip(caches, saved):
            k.copy_(k0)
            v.copy_(v0)
        with torch.inference_mode():
            return model(ids, pos, caches, meta)
    return run, meta
