"""Which heads sit on the attention sink and which look most sharply elsewhere, for one step's attention record.

One answer for every view that says it (the terminal's section 5d, the HTML report, README's figures): a head is on
the sink when its highest weight is on position 0 (the first token); the most focused heads are the others with
the lowest entropy (all heads when every head is on the sink), ties broken by layer, then head. Pure Python over
the records (AttentionStep), so a trace read back from JSON gives the same heads.
"""

from __future__ import annotations

from llmtrace.tracer.trace.journey_records import AttentionStep, HeadFocus

FOCUSED_HEADS = 6  # the terminal's list: enough to show a pattern, few enough for a panel


def sink_heads(step: AttentionStep) -> tuple[HeadFocus, ...]:
    """The heads whose highest weight is on position 0."""
    return tuple(h for h in step.heads if h.top_positions[0] == 0)


def focused_heads(step: AttentionStep, count: int = FOCUSED_HEADS) -> tuple[HeadFocus, ...]:
    """The `count` lowest-entropy heads not on the sink (of all heads when every one is)."""
    elsewhere = [h for h in step.heads if h.top_positions[0] != 0] or list(step.heads)
    return tuple(sorted(elsewhere, key=lambda h: (h.entropy_bits, h.layer, h.head))[:count])
