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
    for k in MEAN_KEYS:
        if k in out:
            out[k] /= len(per)
    if out.get("spec_num_draft_tokens"):
        out["spec_acceptance_rate"] = out["spec_num_accepted_tokens"] / out["spec_num_draft_tokens"]
        out["spec_mean_accepted_length"] = 1 + out["spec_num_accepted_tokens"] / out["spec_num_drafts"]
    return out
