"""The summary of a paired A/B: two sides measured in turn, pair by pair (invariance_ab, vllm_no_docs_ab)."""

from __future__ import annotations

import json
import statistics


def in_turn(sides, pair: int) -> list:
    """The sides in the order pair number `pair` measures them: alternating, so neither side always goes first."""
    return list(sides) if pair % 2 == 0 else list(sides)[::-1]


def summary(samples: dict[str, dict[str, list[float]]], side: str, against: str, digits: int = 3) -> dict:
    """Each side's medians, and the median of the paired ratios side / against, for every measure."""
    medians = {name: {k: round(statistics.median(v), digits) for k, v in s.items()} for name, s in samples.items()}
    ratios = {k: round(statistics.median(a / b for a, b in zip(samples[side][k], samples[against][k])), 3)
              for k in samples[side]}
    return {"medians": medians, f"{side}_over_{against}_median_ratio": ratios}


def emit(result: dict, out: str) -> None:
    print(json.dumps(result, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
