"""Exit mode: one decode loop (`loop.py`: one token per step for every row) over two step backends.

- The walk (`loop.Walk`): the session's forward a step (`session.ExitSession`: each token walks the layers and
  leaves at the first checkpoint whose router says so; in compiled calls the walk of a single row can run as one
  graph, `walkgraph.ExitGraph`).
- The graph (`graph.GraphSteps`): a compiled single-row step from the last token to the next as one graph, the
  processors inside it, and one host read.
"""
