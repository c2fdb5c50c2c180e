"""Speculative decoding, in one package. The engine calls it once a step (Speculator.step, a
context around the step) and it calls down only: into the proposers and the runner, never back.

  speculator.py   which sequences draft this step and how many (the batch cutoff, each sequence's
                  measured acceptance), the verification of a step's drafts, build_speculator
  proposer.py     the proposer interface; ngram.py (prompt lookup), draft_model.py (a small model
                  on a runner and page pool of its own), eagle.py (an EAGLE-3 head reading the
                  target's hidden states, its cache on the target's page numbers), suffix.py
  rejection.py    exact rejection sampling in torch: the target's distribution per position, the
                  accept / resample rule, the draws of a draft model
  clock.py        the step clock: a verify step's cost in plain decode steps, from the timed steps
  metrics.py      the counters the server and `ridge bench` report

The verify forward is the runner's own (a scheduled item with drafts gets num_draft + 1 logits
rows, the verify CUDA graphs), and the runner offers the per-row sampling parameters
(`ModelRunner.sampling_batch`) that rejection sampling applies; the engine commits the emitted
tokens a position at a time (Committer.commit_runs). Rejection sampling lives here rather than
beside the sampler in ridge/layers: its only callers are the verification and the draft
proposer, both in this package, and the runner never calls it."""
