"""One ``stats()`` dict from several engine cores' (data parallel, P/D): counts and pool sizes
summed, rates averaged or recomputed from the summed counts, so that /metrics reads the same keys
whatever the number of cores behind the front end."""
from __future__ import annotations

MEAN_KEYS = ("kv_usage", "prefix_cache_hit_rate", "mean_scheduled_tokens_per_step", "mean_queue_time_s")


def combine(per: list[dict]) -> dict:
    """Numbers summed over ``per`` (booleans and nested values left out), ``MEAN_KEYS`` averaged,
    the speculative-decoding rates recomputed from the summed counts (not a mean of means)."""
    out: dict = {}
    for s in per:
        for k, v in s.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    tokens = [s["moe_expert_tokens"] for s in per if s.get("moe_expert_tokens")]
    if tokens:  # MoE: per-expert counts summed across the cores, imbalance from the sums
        out.update(moe_stats([sum(col) for col in zip(*tokens)], []))
        out.pop("moe_last_step_expert_tokens")
    for k in MEAN_KEYS:
        if k in out:
            out[k] /= len(per)
    if out.get("spec_num_draft_tokens"):
        out["spec_acceptance_rate"] = out["spec_num_accepted_tokens"] / out["spec_num_draft_tokens"]
        out["spec_mean_accepted_length"] = 1 + out["spec_num_accepted_tokens"] / out["spec_num_drafts"]
    return out


def moe_stats(total: list[int], last: list[int]) -> dict:
    """Mixture-of-experts load balance (empty for dense models): tokens routed to each expert since
    start and in the last step, and the imbalance max/mean of the totals (1.0 = perfectly even)."""
    if not total:
        return {}
    mean = sum(total) / len(total)
    return {"moe_expert_tokens": list(total), "moe_last_step_expert_tokens": list(last),
            "moe_expert_imbalance": max(total) / mean if mean else 0.0}
