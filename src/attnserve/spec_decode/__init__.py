"""Speculative decoding on the ranks, in one package: the `Proposer` interface (`proposer`) and
its two proposers (`ngram_proposer`: prompt lookup; `draft_model_proposer`: a draft model),
`DraftRows` (the draft tokens in a rank's persistent batch), the verify step's draws and the
tokens it keeps (`verifier`), and the counts behind its metrics (`metrics`). The engine keeps
only the pace: which sequences draft after a step, and how many drafts each keeps
(`engine/core/speculator.py`)."""
