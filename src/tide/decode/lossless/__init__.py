"""Lossless mode: one decode loop (`loop.py`: draft, verify, accept, repeat) over two cycle backends.

- Draft and verify (`loop.DraftVerify`): a drafter proposes (`chain.ChainDrafter`, `tree.TreeDrafter`, with
  `ngram.NgramDrafter`'s continuations; what a draft is: `drafts.py`), the verifier runs the full model over it
  (`verifier.Verifier`, on the shallow passes the drafts ran: `shallow.ShallowPasses`), and `accept.py` decides.
- The graph (`graph.GraphCycles`): a compiled cycle as one graph and one host read, trees included
  (`graphtree.py`).

`session.LosslessSession` is a call's configuration and the resources its drafters and verifier share.
"""
