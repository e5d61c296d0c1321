"""The load decision's bars on a throttled mount, checked the same way for both engines.

``tests/gpu_fs/test_gpu_fs_load_decision_fuse.py`` (vLLM) and ``tests/tpu_engine/
test_tpu_engine_load_decision_fuse.py`` (tpu-inference) run their engine's ``--mount fuse``
benchmark small and hand its JSON here: at every speed the default's (``auto``) median TTFT is
within ``MEDIAN_BAR`` of the better of ``always`` and ``never``, and every ``auto`` request that bet
on the files (chunks promoted from them: loaded, or given up by the hedge) took at most
``WORST_BAR`` times the recompute time (that speed's ``never`` median), the first file hit after
the start at that speed included. One that recomputed at once took its own recompute time: a
stall of a loaded machine there is no wait for the mount (``never``'s own samples spread as far).
"""

from __future__ import annotations

import statistics

MEDIAN_BAR = 1.15  # the default's median over the better mode's
WORST_BAR = 2.0  # any default request that bet on the files, over its recompute time
SPEEDS = ("7x recompute", "1x recompute", "fast")  # the benchmark's row names for --speeds 7 1 0


def by_speed(res: dict) -> dict:
    """``{speed name: {"ttft_s": {mode: [...]}, "chunks_loaded": {mode: [...]}}}`` from either
    benchmark's JSON (vLLM's keys its samples by speed; tpu-inference's lists them with a ``mount``)."""
    samples = res["samples"]
    if isinstance(samples, list):
        return {s["mount"]: s for s in samples}
    return samples


def check(res: dict, *, loading_wins_unthrottled: bool = True) -> None:
    """Assert the premises (loading loses by far on the slowest mount and, where the engine's model
    makes it so, wins unthrottled) and the bars."""
    assert all(s["probed"] for s in res["speeds"].values()), ("the probe did not price every speed", res["speeds"])
    table = {}
    for name, s in by_speed(res).items():
        t, loaded = s["ttft_s"], s["chunks_loaded"]
        table[name] = ({m: statistics.median(v) for m, v in t.items()}, t, loaded)
    slow, _, fast = (table[k] for k in SPEEDS)
    if loading_wins_unthrottled:
        assert fast[0]["always"] < fast[0]["never"], ("unthrottled, loading must beat recomputing", fast)
    assert slow[0]["always"] > 3 * slow[0]["never"], ("at 7x, loading must lose by far", slow)
    assert all(n > 0 for n in fast[2]["always"]) and all(n > 0 for n in slow[2]["always"]), "always loads"
    for name, (med, t, loaded) in table.items():
        best = min(med["always"], med["never"])
        assert med["auto"] <= MEDIAN_BAR * best, (name, "auto's median over the better mode's", med, t, loaded)
        bets = [s for s, n in zip(t["auto"], loaded["auto"]) if n]
        assert all(s <= WORST_BAR * med["never"] for s in bets), (name, "a bet past twice a recompute", bets, med, t)
