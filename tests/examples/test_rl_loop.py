"""examples/rl_loop.py: the GRPO-shaped loop's mean reward rises (from chance, ~1/8) as the engine's
weights are updated in place after every step; every rollout token came from the current weights
(the example asserts it), and the trainer's logprobs of the engine's samples match the engine's."""
from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"


def test_reward_rises():
    spec = importlib.util.spec_from_file_location("rl_loop", EXAMPLE)
    rl_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rl_loop)
    history = rl_loop.main(steps=8, verbose=True)
    print("[rl_loop] mean reward per step:", [round(r, 3) for r in history])
    assert sum(history[-2:]) / 2 > sum(history[:2]) / 2 + 0.1
