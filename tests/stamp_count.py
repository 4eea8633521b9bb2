"""The test oracle for how many clock readings a traced C step writes: counted here from the stages, apart from C's
own count (decode_step.c's llmt_step_stamps), which NativeStep sizes its buffer by."""

from __future__ import annotations

STAGES_BEFORE_LAYERS = 1  # the embedding (and Gemma's × √d: `stamp_count`)
STAGES_PER_LAYER = 14  # the fused path's layer stages (contract.fused_stages); the C step stamps each
STAGED_STAGES_PER_LAYER = 17  # the staged path's (contract.staged_stages): Q, K, V and gate, up apart
# (each one more with QK-norm, Qwen3's, two more with Gemma's norms after attention and FFN: `stamp_count`)
STAGES_AFTER_LAYERS = 2  # final norm, LM head (and Gemma's soft-cap)


def stamp_count(layers: int, staged: bool, qk_norm: bool = False, experts: int = 0, post_norms: bool = False,
                embed_scale: bool = False, softcap: bool = False, shared_expert: bool = False) -> int:
    """Clock readings of a traced step of `layers` layers: its start, then one after each stage (QK-norm's, one a
    layer, where the model has it; Gemma's norms after attention and FFN, two a layer, its × √d after the embedding
    and its soft-cap after the LM head; a mixture of `experts` chosen experts a token: router, route, each expert's
    gate|up (gate, up when staged), silu*up and down, and the weighted sum in place of gate|up, silu*up, down; and
    with a `shared_expert` (Qwen2-MoE) its gate|up (gate, up when staged), silu*up, down and gate logit, and its
    gated add)."""
    per_layer = (STAGED_STAGES_PER_LAYER if staged else STAGES_PER_LAYER) + int(qk_norm) + 2 * int(post_norms)
    if experts:  # router, route and the weighted sum stand for the dense FFN's gate|up, silu*up, down (staged: gate,
        per_layer += 4 * experts - 1 if staged else 3 * experts  # up, silu*up, down), then each expert's own
    if shared_expert:
        per_layer += 6 if staged else 5
    return 1 + STAGES_BEFORE_LAYERS + int(embed_scale) + per_layer * layers + STAGES_AFTER_LAYERS + int(softcap)
