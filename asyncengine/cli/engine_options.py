"""The engine's knobs on the command line: one table, ``ENGINE_OPTIONS``, one row per
``EngineConfig`` field, from which every command's flags and the ``EngineConfig`` keyword arguments
are generated (and the defaults the help shows are read from ``EngineConfig`` itself), so the two
cannot drift; fields deliberately left off the command line say why in ``NOT_ON_THE_COMMAND_LINE``.
A new knob is one more row. Imports no torch (``--help`` stays fast)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Callable

from asyncengine.config.attention import BACKEND_CHOICES  # torch-free: the backends' table

COMMANDS = ("chat", "generate", "serve")

def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1.5G', '1000000' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    for u, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(u):
            t, m = t[:-len(u)], mult
            break
    else:
        m = 1
    try:
        n = int(float(t) * m)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0: {text!r}")
    return n


def parse_json_object(text: str) -> dict:
    """A JSON object given on the command line, as vLLM's ``--speculative-config`` takes it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {type(value).__name__}: {text!r}")
    return value


def _positive(kind: Callable) -> Callable:
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v

    parse.__name__ = kind.__name__
    return parse


POSITIVE_INT = _positive(int)
POSITIVE_FLOAT = _positive(float)
FLAG = "flag"  # a boolean knob: --name / --no-name


@dataclasses.dataclass(frozen=True)
class EngineOption:
    """One ``EngineConfig`` field on the command line.

    default_text: what the help says the default is when the field's own default is None (or needs
    words); per_command: a default that differs by command (e.g. max_num_seqs), shown in each
    command's help."""

    field: str
    help: str
    type: Callable | str = str
    choices: tuple | None = None
    metavar: str | None = None
    flag: str | None = None  # default: --field-with-dashes
    short: str | None = None
    default_text: str | None = None
    per_command: dict[str, Any] | None = None
    commands: tuple[str, ...] = COMMANDS

    @property
    def option(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")


ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    EngineOption("tokenizer", "a Hugging Face tokenizer folder to use instead of the model's",
                 default_text="the model's own", metavar="PATH"),
    EngineOption("dtype", "compute dtype; auto = the engine's choice for this model on this machine "
                          "(bfloat16 on a GPU; on CPU chosen by the weights and a measured probe; the "
                          "ready line says which and why)",
                 choices=("auto", "float32", "bfloat16", "float16")),
    EngineOption("device", "where the model runs: auto = cuda when torch sees a GPU, else cpu",
                 metavar="{auto,cpu,cuda,cuda:N}"),
    EngineOption("quantization", "weights: by default the checkpoint's own format (a GGUF's Q4_0/Q4_1/Q8_0 "
                                 "tensors stay quantized and run on CPU kernels; safetensors load dense); "
                                 "int8 / int4 = quantize dense weights at load (Q8_0 / Q4_1 blocks, CPU); "
                                 "none = dequantize everything",
                 choices=("none", "int8", "int4"), default_text="the checkpoint's own format"),
    EngineOption("max_model_len", "longest conversation in tokens", type=POSITIVE_INT,
                 default_text="the model's context length"),
    EngineOption("kv_cache_bytes", "KV cache size, e.g. 512MiB or 2GiB", type=parse_size,
                 flag="--kv-cache-memory", metavar="SIZE",
                 default_text="what --max-num-seqs sequences of --max-model-len tokens need, at most "
                              "--kv-cache-memory-fraction of the available memory; memory is only used as "
                              "conversations fill it"),
    EngineOption("kv_offload_bytes", "host-memory tier for prefix-cache blocks evicted from the KV cache, "
                                     "e.g. 4GiB (docs/kv_connector.md)", type=parse_size, flag="--kv-offload-memory",
                 metavar="SIZE", default_text="off; 512MiB when --kv-offload-dir is given"),
    EngineOption("kv_offload_dir", "directory that keeps computed prompt blocks across restarts (several "
                                   "engines may share it)", metavar="DIR", default_text="off"),
    EngineOption("kv_offload_dir_bytes", "size bound of --kv-offload-dir, least recently used files out first",
                 type=parse_size, flag="--kv-offload-dir-size", metavar="SIZE", default_text="8GiB"),
    EngineOption("kv_cache_memory_fraction", "the most of the available memory a KV cache sized by need "
                                             "may reserve, (0, 1]", type=POSITIVE_FLOAT),
    EngineOption("num_kv_blocks", "KV cache size in blocks (instead of --kv-cache-memory)", type=POSITIVE_INT,
                 default_text="sized by need, as --kv-cache-memory"),
    EngineOption("block_size", "tokens per KV cache block (a power of two)", type=POSITIVE_INT),
    EngineOption("kv_cache_dtype", "KV cache storage: int8 = 8-bit keys and values, one scale per token and KV "
                                   "head (about twice the blocks in the same memory; cpu and torch attention "
                                   "backends; docs/kv_cache_int8.md); auto = the model's dtype",
                 choices=("auto", "int8")),
    EngineOption("max_num_seqs", "most sequences decoded at once", type=POSITIVE_INT,
                 per_command={"chat": 1, "generate": 1, "serve": 256}),
    EngineOption("max_num_batched_tokens", "most tokens in one model step (prefill chunks included)",
                 type=POSITIVE_INT),
    EngineOption("enable_prefix_caching", "reuse the KV blocks of a shared prompt beginning", type=FLAG),
    EngineOption("enable_chunked_prefill", "split long prompts over several steps, beside running decodes",
                 type=FLAG),
    EngineOption("async_scheduling", "schedule step N+1 while step N runs", type=FLAG),
    EngineOption("policy", "the order waiting requests are served in (priority: the request's priority "
                           "field, aged)", choices=("fcfs", "priority"), commands=("serve",)),
    EngineOption("priority_aging_s", "with --policy priority: a waiting request's priority improves by 1 "
                                     "every this many seconds", type=POSITIVE_FLOAT, commands=("serve",)),
    EngineOption("restart_dead_cores", "data parallel: replace a dead engine core with a fresh one (the others "
                                       "serve meanwhile)", type=FLAG, commands=("serve",)),
    EngineOption("max_queued_requests", "waiting requests before the server answers 429", type=POSITIVE_INT,
                 commands=("serve",)),
    EngineOption("max_queued_tokens", "waiting prompt tokens before the server answers 429", type=POSITIVE_INT,
                 default_text="unlimited", commands=("serve",)),
    EngineOption("attention_backend", "attention over the KV cache; auto = triton on a GPU, else cpu (C "
                                      "kernels, built once per machine) where a C compiler is found, else torch",
                 choices=BACKEND_CHOICES),
    EngineOption("model_impl", "which implementation runs the model: native (ours), transformers (the "
                               "Transformers backend: transformers' model code, our paged attention), auto = "
                               "native where we have one", choices=("auto", "native", "transformers")),
    EngineOption("runner", "what the engine serves (vLLM's --runner): generate, pooling (embeddings, rerank "
                           "scores only), auto = by architecture (BERT encoders pool, decoders generate)",
                 choices=("auto", "generate", "pooling")),
    EngineOption("seed", "engine random seed", type=int),
    EngineOption("batch_invariant", "bitwise the same tokens and logprobs for a request alone or in any batch "
                                    "(CPU; docs/batch_invariance.md)", type=FLAG),
    EngineOption("quantized_activations", "activations for the block-quantized (GGUF Q4/Q8) kernels: int8 "
                                          "(integer dot products, llama.cpp's method) or fp32; auto = int8",
                 choices=("auto", "int8", "fp32")),
    EngineOption("num_threads", "torch threads per worker", type=POSITIVE_INT,
                 default_text="torch's, lowered while other processes keep cores busy; a number pins it"),
    EngineOption("freeze_gc_after_load", "freeze the objects alive after the load out of the cycle "
                                         "collector's full passes (engine_core/gc_policy.py)", type=FLAG),
    EngineOption("engine_core_process", "run the engine core (scheduler, KV cache, model) in its own process, "
                                        "so the model step never competes with this process's Python for the "
                                        "GIL; this process then imports no torch", type=FLAG),
    EngineOption("tensor_parallel_size", "split the model over this many worker processes (Megatron tensor "
                                         "parallel)", type=POSITIVE_INT, short="-tp"),
    EngineOption("pipeline_parallel_size", "split the layers into this many stages (worker processes), batches "
                                           "pipelined", type=POSITIVE_INT, short="-pp"),
    EngineOption("data_parallel_size", "run this many engine cores (processes), each with its own KV cache",
                 type=POSITIVE_INT, short="-dp"),
    EngineOption("prefill_cores", "disaggregated prefill/decode: this many engine cores (processes) only "
                                  "prefill, and hand each prompt's KV to a decode core (docs/kv_connector.md); "
                                  "needs --decode-cores", type=POSITIVE_INT, default_text="off",
                 commands=("serve",)),
    EngineOption("decode_cores", "disaggregated prefill/decode: this many engine cores (processes) decode",
                 type=POSITIVE_INT, default_text="off", commands=("serve",)),
    EngineOption("pd_skip_hop_below", "with --prefill-cores: prompts of fewer tokens skip the prefill core "
                                      "and are computed by the decode core", type=int, metavar="TOKENS",
                 commands=("serve",)),
    EngineOption("kv_transfer_transport", "with --prefill-cores: how prompt KV moves to a decode core: shm = files "
                                          "in shared memory (one host), tcp = pulled from the prefill core over TCP",
                 choices=("shm", "tcp"), commands=("serve",)),
    EngineOption("distributed_executor_backend", "uni: one thread; mp: worker processes; ray: Ray actors",
                 choices=("uni", "mp", "ray"), default_text="uni at --tensor-parallel-size 1, else mp"),
    EngineOption("distributed_timeout_s", "a collective that waits this long for a peer rank fails the "
                                          "engine (never a hang)", type=POSITIVE_FLOAT),
    EngineOption("tp_vocab_parallel", "under tensor parallel, split the embedding and LM head by vocabulary "
                                      "(less memory per rank, one more collective per step); "
                                      "--no-tp-vocab-parallel replicates them", type=FLAG),
    EngineOption("enable_expert_parallel", "under tensor parallel, each rank holds 1/N of every mixture-of-experts "
                                           "layer's experts whole instead of 1/N of every expert", type=FLAG),
    EngineOption("ray_placement_strategy", "with the ray backend: how the ranks' bundles go on nodes "
                                           "(STRICT_SPREAD = one rank per node)",
                 choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")),
    EngineOption("gpu_memory_utilization", "CUDA: the share of the GPU's memory the engine may use, (0, 1]",
                 type=POSITIVE_FLOAT),
    EngineOption("enforce_eager", "CUDA: never capture CUDA graphs for decode steps", type=FLAG),
    EngineOption("speculative_config", "speculative decoding, as vLLM takes it: a JSON object, e.g. "
                                       "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' or "
                                       "'{\"method\": \"draft_model\", \"model\": \"PATH\", "
                                       "\"num_speculative_tokens\": 3}' (docs/speculative_decoding.md)",
                 type=parse_json_object, metavar="JSON", default_text="off"),
    EngineOption("enable_lora", "serve PEFT LoRA adapters over the base model (docs/lora.md)", type=FLAG,
                 commands=("serve",)),
    EngineOption("max_loras", "most distinct LoRA adapters in one model step", type=POSITIVE_INT,
                 commands=("serve",)),
    EngineOption("max_lora_rank", "largest LoRA rank accepted (the device slots are sized for it)",
                 type=POSITIVE_INT, commands=("serve",)),
    EngineOption("max_cpu_loras", "LoRA adapters kept loaded in host memory (least recently used out)",
                 type=POSITIVE_INT, default_text="--max-loras", commands=("serve",)),
    EngineOption("limit_mm_per_prompt", "images one prompt may carry (vision-language models; docs/multimodal.md)",
                 type=int),
    EngineOption("mm_max_pixels", "decoded pixels of one image (width x height), checked before decoding",
                 type=POSITIVE_INT),
    EngineOption("mm_encoder_cache_tokens", "image-encoder output rows the worker keeps for reuse", type=int),
    EngineOption("max_num_encoder_input_tokens", "image placeholder rows one step may send through the "
                                                 "image encoder (an image larger than this goes alone)",
                 type=POSITIVE_INT, default_text="--max-num-batched-tokens"),
)

# EngineConfig fields deliberately not on the command line, and why
NOT_ON_THE_COMMAND_LINE = {
    "model": "the MODEL argument (serve, chat) or --model (generate)",
    "skip_tokenizer_init": "every command reads and writes text",
    "limits": "serve's request-limit flags (--max-request-bytes, --max-prompt-chars, ...)",
    "kv_role": "set by the P/D front end (engine/pd_client.py) for the cores it starts",
    "kv_transfer_dir": "set by the P/D front end (engine/pd_client.py) for the cores it starts",
    "kv_transfer_lease_s": "set by the P/D front end (engine/pd_client.py) for the cores it starts",
    "kv_transfer_address": "set by the P/D front end (engine/pd_client.py) for each prefill core (tcp transport)",
    "grammar_limits": "serve's structured-output limit flags (--max-grammar-compile-s, --max-enum-values, ...)",
}


def _engine_defaults() -> dict[str, Any]:
    """EngineConfig's own field defaults (asyncengine.config imports no torch)."""
    from asyncengine.config import EngineConfig  # lazy: the CLI parses and checks flags without importing the engine (start-up time)

    return {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}


def default_text(opt: EngineOption, command: str, defaults: dict[str, Any]) -> str:
    """What ``command --help`` says the default of ``opt`` is: the effective one."""
    if opt.per_command and command in opt.per_command:
        return str(opt.per_command[command])
    if opt.default_text is not None:
        return opt.default_text
    value = defaults[opt.field]
    if opt.type is FLAG:
        return "on" if value else "off"
    return str(value)


def add_engine_options(p: argparse.ArgumentParser, command: str) -> None:
    defaults = _engine_defaults()
    g = p.add_argument_group("engine (EngineConfig's fields)")
    for opt in ENGINE_OPTIONS:
        if command not in opt.commands:
            continue
        names = [opt.option] + ([opt.short] if opt.short else [])
        help_text = f"{opt.help} (default: {default_text(opt, command, defaults)})"
        kw: dict[str, Any] = {"dest": opt.field, "default": None, "help": help_text}
        if opt.type is FLAG:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = opt.type
            if opt.choices:
                kw["choices"] = opt.choices
            if opt.metavar:
                kw["metavar"] = opt.metavar
        g.add_argument(*names, **kw)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the parsed flags: those given, plus the per-command
    defaults; the rest keep EngineConfig's own defaults."""
    kw: dict[str, Any] = {}
    for opt in ENGINE_OPTIONS:
        if args.cmd not in opt.commands:
            continue
        value = getattr(args, opt.field, None)
        if value is None and opt.per_command:
            value = opt.per_command.get(args.cmd)
        if value is not None:
            kw[opt.field] = value
    return kw
