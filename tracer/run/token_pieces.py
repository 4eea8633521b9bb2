"""A run's tokens as its records show them: each token's display piece, and the sampler's candidates as records."""

from __future__ import annotations

from typing import Any

from llmtrace.tracer.run.sampling import Candidate
from llmtrace.tracer.trace.records import CandidateRecord


class TokenPieces:
    """Display pieces looked up once a run: a step's record shows its token and ten candidates, and the tokenizer
    rebuilds a byte-level piece from its bytes on every call (~8 us each)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._pieces: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._tokenizer.piece(token_id)
        return piece

    def candidate(self, c: Any) -> CandidateRecord:
        """A sampler's candidate (tracer/run/sampling.py's Candidate, or another sampler's of the same fields)."""
        if type(c) is Candidate:  # the Sampler's own: plain Python values already (a step makes ten of these)
            return CandidateRecord(c.token_id, self.piece(c.token_id), c.logit, c.logit_penalized, c.prob_raw,
                                   c.prob_tempered, c.kept_top_k, c.kept_top_p, c.kept_min_p, c.prob_final)
        return CandidateRecord(
            token_id=int(c.token_id), piece=self.piece(int(c.token_id)), logit=float(c.logit),
            logit_penalized=float(getattr(c, "logit_penalized", c.logit)),
            prob_raw=float(c.prob_raw), prob_tempered=float(c.prob_tempered), kept_top_k=bool(c.kept_top_k),
            kept_top_p=bool(c.kept_top_p), kept_min_p=bool(c.kept_min_p), prob_final=float(c.prob_final),
        )
