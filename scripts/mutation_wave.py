"""The mutants of the last two waves' features, for scripts/mutation_check.py (group ``wave``):
issue 40's five unguarded places, one per KV connector (offload host and disk tiers, P/D over shm
and over tcp), one per parallelism mode (TP, PP, DP) and one per C kernel family (dense GEMM,
paged attention, quantized GEMM, native step). Each row: (id, file relative to the repository, the
exact code, its replacement, the area's own tests (pytest arguments), the guard it removes).
"""
from __future__ import annotations

OFFLOAD = "tests/kv_connector/test_offload_connector.py"
HYBRID = "tests/models/test_hybrid_parity.py"
BI = "tests/engine/test_batch_invariance.py"
SSM_DROP = ("asyncengine/layers/mamba2.py",
            "                                None if fresh else ssm_state[slot])",
            "                                None)")


def _ssm(arch: str) -> tuple:
    return (f"ssm.drop_between_chunks.{arch}", *SSM_DROP, [HYBRID, "-k", f"chunked and {arch} or chunks_carry and {arch}"],
            f"{arch}: a prefill chunk continues from the SSM state the previous chunk left")


WAVE = [
    # ------------------------------------------------------------------ issue 40's five places
    ("offload.stage_past_host_gap", "asyncengine/kv_connector/offload/scheduler.py",
     "        while (k < end and self.host.lookup(hashes[k]) is None and not self.host.is_pending(hashes[k])",
     "        while (k < end and not self.host.is_pending(hashes[k])",
     [OFFLOAD, "-k", "chunked_prefill_and_preemption"],
     "disk staging stops at a block the host tier holds (the bug the preempting, chunking test found)"),
    _ssm("mamba2"), _ssm("bamba"), _ssm("nemotron_h"), _ssm("granitemoehybrid"),
    ("disk.crc", "asyncengine/kv_connector/offload/disk_store.py",
     "                if zlib.crc32(view) != crc:", "                if False:",
     [OFFLOAD, "-k", "flipped_bit_alone"], "disk tier: a block file whose payload fails its CRC is refused"),
    # ------------------------------------------------------------------ KV connectors
    ("offload.host_load", "asyncengine/kv_connector/offload/scheduler.py",
     "            self._loads.append((slot, blocks[i].block_id))\n", "",
     [OFFLOAD, "-k", "host_tier"], "host tier: a hit is copied into the device blocks it was given"),
    ("pd.shm_accept", "asyncengine/kv_connector/pd/transport.py",
     "        if h is None or not accept(h):\n            return None\n        dst = tf.claimed_path(self.dir, key)\n"
     "        try:",
     "        if h is None:\n            return None\n        dst = tf.claimed_path(self.dir, key)\n        try:",
     ["tests/kv_connector/test_pd_connector.py"], "P/D shm: a transfer for another prompt or model is not loaded"),
    ("pd.tcp_accept", "asyncengine/kv_connector/pd/transport.py",
     "        if h is None or not accept(h):\n            return None\n        dst = tf.claimed_path(self.dir, key)\n"
     "        os.makedirs",
     "        if h is None:\n            return None\n        dst = tf.claimed_path(self.dir, key)\n        os.makedirs",
     ["tests/kv_connector/test_pd_tcp.py"], "P/D tcp: a pulled transfer for another prompt or model is not loaded"),
    # ------------------------------------------------------------------ parallelism
    ("tp.all_reduce", "asyncengine/layers/parallel.py",
     "                dist.all_reduce(x, group=self.group)\n", "",
     ["tests/executor/test_tensor_parallel.py"], "TP: row-parallel layers sum every rank's part"),
    ("pp.layer_split", "asyncengine/layers/parallel.py",
     "        out.append((start, start + n))", "        out.append((start + (s > 0), start + n))",
     ["tests/executor/test_pipeline_parallel.py"], "PP: each stage runs all of its layers"),
    ("dp.least_loaded", "asyncengine/engine/dp_router.py",
     "        least = min(range(len(loads)), key=lambda k: (loads[k], k))",
     "        least = max(range(len(loads)), key=lambda k: (loads[k], k))",
     ["tests/engine/test_dp_router.py", "tests/engine/test_data_parallel.py"],
     "DP: a request without a useful prefix goes to the least loaded core"),
    # ------------------------------------------------------------------ C kernels (kernels/cpu)
    ("kernel.dense_bias", "kernels/cpu/invariant.c",
     "            float v = inv_hsum(acc[i][j]);\n            if (bias) v += inv_load(bias, n0 + j, bf16);\n",
     "            float v = inv_hsum(acc[i][j]);\n",
     ["tests/layers/test_batch_invariant_ops.py"], "dense GEMM (AVX-512 tile): the bias is added"),
    ("kernel.attention_rescale", "kernels/cpu/attention_avx512_rows.h",
     "            corr[r] = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);",
     "            corr[r] = m[r] == -INFINITY ? 0.0f : 1.0f;",
     ["tests/kernels/test_paged_attention.py", "tests/kernels/test_cpu_kernels.py"],
     "paged attention (AVX-512): the running sums are rescaled when a block raises the row's max"),
    ("kernel.quant_q4_0_offset", "kernels/cpu/quant.c",
     "        const float m = type == AE_Q_Q4_1 ? fp16_to_fp32(blk + om) : -8.0f * d;",
     "        const float m = type == AE_Q_Q4_1 ? fp16_to_fp32(blk + om) : -7.0f * d;",
     ["tests/kernels/test_quant_kernels.py"], "quantized GEMM (AVX2, fp32 activations): Q4_0's offset is -8"),
    ("kernel.step_rotary_keys", "kernels/cpu/step.c",
     "        ae_ops_rotary(qkv, qkv_n, qkv, qkv_n, T, Hq + Hkv, D,",
     "        ae_ops_rotary(qkv, qkv_n, qkv, qkv_n, T, Hq, D,",
     ["tests/models/test_llama_native.py"], "native step: rotary embedding on the keys too"),
    # last: only the bf16 batch-1-vs-N test of qwen2 (QKV bias) kills it, after the longer bf16 runs (docs/mutation.md)
    ("invariant.bf16_plain_linear", "asyncengine/layers/linear.py",
     "                return invariant.linear(x, self.weight, self.bias)",
     "                return F.linear(x, self.weight, self.bias)",
     [BI, "-k", "bfloat16"], "batch-invariant mode, bf16: dense layers through the fixed-order kernel"),
]
