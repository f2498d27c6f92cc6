"""LLaVA-1.5 (models/llava.py) token-exact against transformers' own processor + model (fp32,
greedy, the near-tie rule): images alone, mixed with text-only requests, with prefill chunks that
start and end inside an image's placeholder run, and under preemption (recompute re-encodes or
reuses the cached encoder output). The prefix cache keys blocks by image hash: the same image
reuses them, the same text with another image does not."""
from __future__ import annotations

import pytest

from model_utils import compare
from vlm_utils import (IMAGE_REQUESTS, TOKENS_PER_IMAGE, core_process_tokens, greedy, hf_llava_greedy, image,
                       make_tiny_llava, num_encoded, vlm_prompt)

from asyncengine import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REQUESTS = IMAGE_REQUESTS  # tests/vlm_utils.py
REGIMES = {
    "alone": dict(num_kv_blocks=256, block_size=16),
    # chunks of 8 tokens, blocks of 4: chunks start and end inside 16-token placeholder runs
    "chunked": dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=8),
    # 22 blocks of 4 = 88 slots: the longest request fits, the batch does not (recompute)
    "preempt": dict(num_kv_blocks=22, block_size=4),
}


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    d = make_tiny_llava(str(tmp_path_factory.mktemp("llava")))
    return d, hf_llava_greedy(d, REQUESTS)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_llava_parity(llava, regime):
    d, (refs, prompt_ids) = llava
    llm = LLM(d, dtype="float32", device="cpu", **REGIMES[regime])
    outs = llm.generate([vlm_prompt(t, im) for t, im, _ in REQUESTS], [greedy(n) for _, _, n in REQUESTS],
                        use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompt_ids  # placeholders expanded as transformers does
    compare([o.outputs[0].token_ids for o in outs], refs)
    # four distinct images (the first comes twice): each encoded once, whatever the chunks or preemptions
    assert llm.engine.collective_rpc(num_encoded) == [4]
    stats = llm.engine.stats()
    if regime == "preempt":
        assert stats["num_preemptions"] > 0
    else:
        assert stats["num_preemptions"] == 0
    llm.shutdown()


def _max_step_rows(worker) -> int:
    return worker.runner.encoder_cache.max_step_rows


@pytest.mark.parametrize("enc_budget", [None, 32, 8])
def test_llava_encoder_budget(llava, enc_budget):
    """max_num_encoder_input_tokens (core/encoder_budget.py): no step encodes more placeholder rows
    than the budget (16-row images: 32 = two at most; 8 = less than one image, so each goes alone;
    None = the step's 64 tokens), chunks stop before the image that does not fit, tokens stay exact."""
    d, (refs, prompt_ids) = llava
    llm = LLM(d, dtype="float32", device="cpu", num_kv_blocks=256, block_size=4, max_num_batched_tokens=64,
              max_num_encoder_input_tokens=enc_budget)
    outs = llm.generate([vlm_prompt(t, im) for t, im, _ in REQUESTS], [greedy(n) for _, _, n in REQUESTS],
                        use_tqdm=False)
    compare([o.outputs[0].token_ids for o in outs], refs)
    most = llm.engine.collective_rpc(_max_step_rows)[0]
    assert most == {None: 48, 32: 32, 8: TOKENS_PER_IMAGE}[enc_budget]
    assert llm.engine.collective_rpc(num_encoded) == [4]
    llm.shutdown()


def test_same_image_hits_the_prefix_cache_another_does_not(llava):
    d, _ = llava
    llm = LLM(d, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    text = "<image> describe this picture please"
    first = llm.generate(vlm_prompt(text, [image(7)]), greedy(6), use_tqdm=False)[0]
    s1 = llm.engine.stats()
    same = llm.generate(vlm_prompt(text, [image(7)]), greedy(6), use_tqdm=False)[0]
    s2 = llm.engine.stats()
    hits = s2["prefix_cache_hits"] - s1["prefix_cache_hits"]
    n = len(same.prompt_token_ids)
    assert hits == (n - 1) // 4 * 4 and hits >= TOKENS_PER_IMAGE  # all but the block of the last token
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate(vlm_prompt(text, [image(8)]), greedy(6), use_tqdm=False)[0]
    s3 = llm.engine.stats()
    assert s3["prefix_cache_hits"] == s2["prefix_cache_hits"]  # the image opens the prompt: no block shared
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    llm.shutdown()


def test_images_cross_to_an_engine_core_process(llava):
    """engine_core_process=True: the images' encoder inputs cross the core's pipe (msgspec) and the
    async front end processes them on a worker thread; the same tokens as transformers."""
    d, (refs, _) = llava
    picked = [0, 1, 3]

    compare(core_process_tokens(d, [REQUESTS[i] for i in picked]), [refs[i] for i in picked])


def test_image_prompt_round_trips_through_the_offload_tier(llava, tmp_path):
    """The KV offload tier (here its disk, across a restart) keys blocks by the same hashes, images
    included: the same image's prompt is read back (its image is not encoded again) and answers the
    same; the same text with another image reads nothing back."""
    d, _ = llava
    text = "<image> describe this picture please"

    def engine():
        return LLM(d, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, kv_offload_dir=str(tmp_path))

    llm = engine()
    first = llm.generate(vlm_prompt(text, [image(7)]), greedy(6), use_tqdm=False)[0]
    llm.shutdown()
    llm = engine()  # a restart: only the disk remembers
    again = llm.generate(vlm_prompt(text, [image(7)]), greedy(6), use_tqdm=False)[0]
    hits = llm.engine.stats()["kv_offload_disk_hit_tokens"]
    assert hits == (len(again.prompt_token_ids) - 1) // 4 * 4 >= 1 + TOKENS_PER_IMAGE  # past the image's run
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.collective_rpc(num_encoded) == [0]
    other = llm.generate(vlm_prompt(text, [image(8)]), greedy(6), use_tqdm=False)[0]
    assert llm.engine.stats()["kv_offload_disk_hit_tokens"] == hits  # the image opens the prompt: no block
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert llm.engine.collective_rpc(num_encoded) == [1]
    llm.shutdown()


def test_image_prompt_through_pd_transfer(llava, tmp_path):
    """P/D (a prefill core writes the prompt's KV to a transfer file, a decode core loads it): an
    image prompt's KV crosses and the answer is transformers' own; a file written for the same
    tokens with another image is refused (its digest covers the images), not loaded."""
    d, (refs, _) = llava
    xfer = str(tmp_path / "xfer")
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, kv_transfer_dir=xfer)
    pre, dec = LLM(d, kv_role="prefill", **kw), LLM(d, kv_role="decode", **kw)

    def run(llm, rid, i, images=None, n=None) -> list[int]:
        text, imgs, max_tokens = REQUESTS[i]
        req, _ = llm.processor.make_request(rid, vlm_prompt(text, images or imgs), greedy(n or max_tokens))
        llm.engine.add_request(req)
        toks: list[int] = []
        while llm.engine.has_unfinished():
            toks += [t for o in llm.engine.step() if o.req_id == rid for t in o.new_token_ids]
        return toks

    run(pre, "x", 0, n=1)
    compare([run(dec, "x", 0)], [refs[0]])
    assert dec.engine.stats()["kv_transfer_imported_requests"] == 1
    run(pre, "y", 5, images=[image(9)], n=1)  # the same tokens as request 5, another image
    compare([run(dec, "y", 5)], [refs[5]])
    s = dec.engine.stats()
    assert s["kv_transfer_imported_requests"] == 1 and s["kv_transfer_rejected_files"] >= 1
    pre.shutdown()
    dec.shutdown()
