"""Qwen2-VL (models/qwen2_vl.py) token-exact against transformers' own processor + model (fp32,
greedy, the near-tie rule): dynamic-resolution images of several sizes (square, wide, tall, one
shrunk by ``max_pixels``, two of different sizes in one prompt), M-RoPE positions through the
engine, alone, mixed with text-only requests, with prefill chunks that start and end inside an
image's placeholder rows, and under preemption; Qwen2.5-VL through the same class; the native C
step (int8) with the M-RoPE rows. The prefix cache keys blocks by image hash: the same image
reuses them, the same text with another image does not. (The reference's inputs are made as
transformers' Qwen2VLProcessor makes them, tests/qwen_vl_utils.py: the class itself wants
torchvision.)"""
from __future__ import annotations

import pytest
import safetensors.torch

from model_utils import compare
from qwen_vl_utils import hf_qwen2_vl_greedy, make_tiny_qwen2_vl
from vlm_utils import core_process_tokens, greedy, image, num_encoded, vlm_prompt

from asyncengine import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
# (text, images, max tokens). Rows per image (patch 14, merge 2): 56x56 -> 2x2 = 4; 168x56 (wide)
# -> 2x6 = 12; 112x112 -> 4x4 = 16; 28x84 (tall) -> 3x1 = 3; 300x200 -> shrunk under max_pixels
REQUESTS = [
    (f"The quick {IMG} brown fox", [image(1, (56, 56))], 10),
    ("def f(x):", [], 8),
    (f"{IMG}\nParis is the capital of", [image(2, (168, 56))], 12),
    (f"Two: {IMG} and {IMG}, compare", [image(3, (112, 112)), image(4, (28, 84))], 9),
    ("The lazy dog", [], 6),
    (f"{IMG} again the first", [image(1, (56, 56))], 7),
    (f"big {IMG} shrunk", [image(5, (300, 200))], 6),
]
REGIMES = {
    "alone": dict(num_kv_blocks=256, block_size=16),
    # chunks of 8 tokens, blocks of 4: chunks start and end inside the 12- and 16-row runs
    "chunked": dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=8),
    # 16 blocks of 4 = 64 slots: the longest request fits, the batch does not (recompute)
    "preempt": dict(num_kv_blocks=16, block_size=4),
}


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    d = make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_vl")))
    return d, hf_qwen2_vl_greedy(d, REQUESTS)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_qwen2_vl_parity(qwen2_vl, regime):
    d, (refs, prompt_ids) = qwen2_vl
    llm = LLM(d, dtype="float32", device="cpu", **REGIMES[regime])
    outs = llm.generate([vlm_prompt(t, im) for t, im, _ in REQUESTS], [greedy(n) for _, _, n in REQUESTS],
                        use_tqdm=False)
    # placeholders expanded as transformers does, image by image (each its own grid)
    assert [o.prompt_token_ids for o in outs] == prompt_ids
    compare([o.outputs[0].token_ids for o in outs], refs)
    # five distinct images (the first comes twice): each encoded once, whatever the chunks or preemptions
    assert llm.engine.collective_rpc(num_encoded) == [5]
    stats = llm.engine.stats()
    assert (stats["num_preemptions"] > 0) == (regime == "preempt")
    llm.shutdown()


def test_same_image_hits_the_prefix_cache_another_does_not(qwen2_vl):
    d, _ = qwen2_vl
    llm = LLM(d, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    text = f"{IMG} describe this picture please"
    first = llm.generate(vlm_prompt(text, [image(7, (112, 56))]), greedy(6), use_tqdm=False)[0]
    s1 = llm.engine.stats()
    same = llm.generate(vlm_prompt(text, [image(7, (112, 56))]), greedy(6), use_tqdm=False)[0]
    s2 = llm.engine.stats()
    hits = s2["prefix_cache_hits"] - s1["prefix_cache_hits"]
    n = len(same.prompt_token_ids)
    assert hits == (n - 1) // 4 * 4 and hits >= 8  # all but the block of the last token: the image's too
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate(vlm_prompt(text, [image(8, (112, 56))]), greedy(6), use_tqdm=False)[0]
    s3 = llm.engine.stats()
    assert s3["prefix_cache_hits"] == s2["prefix_cache_hits"]  # the image opens the prompt: no block shared
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    llm.shutdown()


def test_processor_wraps_chat_images_and_checks_grids(qwen2_vl):
    """A chat image part becomes <|vision_start|><|image_pad|><|vision_end|> (as Qwen2-VL's chat
    template writes it); prepared inputs whose grid disagrees with their rows are refused."""
    import msgspec
    import transformers

    from asyncengine.errors import InvalidRequestError
    from asyncengine.models.model_info import read_hf_config
    from asyncengine.multimodal.processor import MultiModalProcessor

    d, _ = qwen2_vl
    tok = transformers.AutoTokenizer.from_pretrained(d)
    mm = MultiModalProcessor(d, read_hf_config(d))
    assert mm.image_part_text(tok) == IMG
    ids, inputs = mm.process(tok.encode(f"a {IMG} b"), {"image": [image(9, (168, 56))]})
    assert [m.grid_thw for m in inputs] == [[1, 4, 12]] and inputs[0].length == 12
    assert mm.check_prepared(ids, inputs) == inputs
    with pytest.raises(InvalidRequestError):
        mm.check_prepared(ids, [msgspec.structs.replace(inputs[0], grid_thw=[1, 4, 10])])  # 40 patches, not 48


def test_qwen2_5_vl_parity_chunked(tmp_path):
    """Qwen2.5-VL through the same class (its windowed ViT is transformers'; the LM and M-RoPE are
    Qwen2-VL's): token-exact, prefill chunks cutting the image runs, text-only rows beside. Its
    head is tied to the embedding, said at the config's top level only."""
    d = make_tiny_qwen2_vl(str(tmp_path), version="2.5", tie=True)
    assert "lm_head.weight" not in safetensors.torch.load_file(f"{d}/model.safetensors")
    picked = [REQUESTS[i] for i in (1, 2, 3)]
    refs, prompt_ids = hf_qwen2_vl_greedy(d, picked)
    llm = LLM(d, dtype="float32", device="cpu", **REGIMES["chunked"])
    outs = llm.generate([vlm_prompt(t, im) for t, im, _ in picked], [greedy(n) for _, _, n in picked], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompt_ids
    compare([o.outputs[0].token_ids for o in outs], refs)
    llm.shutdown()


def _count_native(worker):
    """Count the native step's calls (it runs a quantized model's steps on the CPU)."""
    step = worker.model.native_step
    assert step is not None, "the native step should apply to an int8 Qwen2-VL"

    class Counting:
        calls = 0

        def accepts(self, *a):
            return step.accepts(*a)

        def __call__(self, *a):
            Counting.calls += 1
            return step(*a)

    worker.model.native_step = Counting()


def test_native_step_takes_the_mrope_rows(qwen2_vl, monkeypatch):
    """int8 weights: the native C step (models/llama_native.py) runs prefill chunks and decodes
    with the cos/sin rows the M-RoPE lookup built; token-exact with the per-op path."""
    d, _ = qwen2_vl
    picked = [REQUESTS[i] for i in (0, 1, 2, 3)]
    outs = {}
    for native in ("1", "0"):
        monkeypatch.setenv("ASYNCENGINE_NATIVE_STEP", native)
        llm = LLM(d, dtype="float32", device="cpu", quantization="int8", num_kv_blocks=128, block_size=8,
                  max_num_batched_tokens=16)
        if native == "1":
            llm.engine.collective_rpc(_count_native)
        res = llm.generate([vlm_prompt(t, im) for t, im, _ in picked], [greedy(n) for _, _, n in picked],
                           use_tqdm=False)
        outs[native] = [o.outputs[0].token_ids for o in res]
        if native == "1":
            assert llm.engine.collective_rpc(lambda w: type(w.model.native_step).calls)[0] > 10
        llm.shutdown()
    assert outs["1"] == outs["0"]


def test_the_hub_layout_of_names_loads(qwen2_vl, tmp_path):
    """Checkpoints on the Hub name the LM ``model.*`` and the tower ``visual.*`` (transformers 5
    saves ``model.language_model.*`` / ``model.visual.*``): both load to the same tokens."""
    import shutil

    d, (refs, _) = qwen2_vl
    hub = tmp_path / "hub"
    shutil.copytree(d, hub)
    tensors = safetensors.torch.load_file(f"{d}/model.safetensors")
    renamed = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
               for k, v in tensors.items()}
    assert any(k.startswith("visual.") for k in renamed) and "model.embed_tokens.weight" in renamed
    safetensors.torch.save_file(renamed, f"{hub}/model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(hub), dtype="float32", device="cpu", num_kv_blocks=64, block_size=16)
    text, images, n = REQUESTS[3]
    out = llm.generate(vlm_prompt(text, images), greedy(n), use_tqdm=False)[0]
    compare([out.outputs[0].token_ids], [refs[3]])
    llm.shutdown()


def test_grids_cross_to_an_engine_core_process(qwen2_vl):
    """engine_core_process=True: each image's patches and grid cross the core's pipe (msgspec), the
    async front end processes them on a worker thread; the same tokens as transformers."""
    d, (refs, _) = qwen2_vl
    picked = [1, 3]

    compare(core_process_tokens(d, [REQUESTS[i] for i in picked]), [refs[i] for i in picked])
