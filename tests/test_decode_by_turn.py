"""scripts/decode_by_turn.py: B's decode time less A's, turn by turn, on the turns both replayed alike."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from decode_by_turn import main  # noqa: E402


def _turn(session, turn, tokens, decode_s, **decode):
    return {"session": session, "turn": turn, "output_tokens": tokens, "decode_s": decode_s,
            "placement": {"decode": decode}}


def test_the_loss_per_step_of_each_turn_both_replayed(tmp_path):
    a = [_turn("s", 0, 11, 0.100), _turn("s", 1, 5, 0.040), _turn("t", 0, 21, 0.200)]
    b = [_turn("s", 0, 11, 0.120, borrowed=7, replaced=2, borrowed_hits=9),
         _turn("s", 1, 5, 0.090),  # too few tokens: left out
         _turn("t", 0, 20, 0.300),  # a different output length: not the same turn's work
         _turn("u", 0, 30, 0.500)]  # A never replayed it
    (tmp_path / "results.json").write_text(json.dumps({"turns": {"ostinato": a, "ostinato-borrow": b}}))
    got = main([str(tmp_path)])
    assert [(r["session"], r["turn"]) for r in got] == [("s", 0)]
    assert got[0]["extra_ms"] == 20.0 and got[0]["extra_ms_per_step"] == 2.0  # 10 decode steps after the first token
    assert (got[0]["borrowed"], got[0]["replaced"], got[0]["borrowed_hits"]) == (7, 2, 9)
