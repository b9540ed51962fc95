"""The lossless loop's graph backend (`GraphCycles`): a cycle as one compiled graph and one host read
(`tide_config={"compile": True}`).

A cycle of the loop's draft-and-verify backend (`loop.DraftVerify`) runs the drafter's compiled calls, captures
each pass's layer arguments on the host, checks each draft against the stopping criteria, reads the accepted count
and crops the cache layer by layer: host work between compiled spans. Here, for chains from the draft head (a
full-attention static cache, one attention type), greedy or sampled, a cycle is one graph (`_cycle`, one per chain
width k, and one for n-gram drafts) and one read; `graph_cycles` says whether a call fits it, else why not:

1. **drafts**: the last emitted token x and each of k drafts run through layers 0..E (the draft layer) on the real
   cache, one position a pass; the draft head on each output gives the next draft: its argmax, or a token drawn
   from its distribution after the call's warpers. k follows acceptance as the draft-and-verify chain's cap does
   (`chain.next_cap`: one more after a full accept, the accepted count + 1 after a rejection, up to
   `max_draft`). With `draft_ngram`, where the sequence's latest n-gram occurred before, its continuation is the
   draft instead (the host knows it; x and it run through layers 0..E in one pass). The backbone's own forward does
   the work, on a view of it that holds layers 0..E and no final norm (`graphparts.backbone_view`), so positions,
   rotary tables and masks are made inside the graph as the model makes them. One graph of `max_draft` drafts for
   every cycle (the head always drafting the whole chain, or the continuation's tokens first and the head's after
   them) compiles fewer graphs, and measured 9-15% slower a token on SmolLM2 in bfloat16 (docs/benchmarks.md, "One
   graph a chain, measured").
2. **verification**: layers E+1..L-1 over [x, d1..dk] from their layer-E states (a view that starts at layer E+1
   and ends with the final norm), the head, a minimum length's end-of-sequence scores set to -inf, acceptance
   (greedy: the longest prefix of drafts equal to the full model's argmax; sampling: the speculative-sampling rule,
   its uniform draws and the token after the path drawn on the device), the next cycle's token and context, and
   every cache layer's length cut back to the accepted path. Positions come from the static cache's own length
   tensors, so no graph is made again for another prompt length.
3. **one host read**: the accepted count and the tokens, which the loop (`loop.py`) takes for the stopping
   criteria, the streamer, the sequence and the counters.

A call that names `draft_topk` runs a tree instead, one graph a cycle too, greedy or sampled (`graphtree.py`).

The processors that run in the graph are generate's minimum length, the repetition penalty (on the tokens seen so
far: a mask of the vocabulary the backend keeps on the device, and in the graph each drafted position's drafts
before it) and, sampling, the warpers that read the scores alone (temperature, top-k, top-p, min-p); a call with any
other drafts and verifies. Drafted tokens that would stop generation are not cut before verification (the emitted
tokens are the full model's, whatever was drafted); the loop runs the stopping criteria on the emitted tokens, one
at a time, and drops the tokens after the first that stops with their K/V. The backend follows the n-gram
continuations of the sequence on the host (`ngram.NgramLookup`). The deep view takes the layer-E states as its
input embeddings; what the backbone adds to its inputs before layer 0 (learned positions) is measured once and taken
off (`graphparts.input_offset`), and a backbone that transforms them otherwise (e.g. scales them) is not used.
"""

from __future__ import annotations

import time

import torch

from ...layers.spans import dense
from ..cachepool import dynamic_length, slots
from ..emit import Emitted
from ..graphparts import GraphProcessors, causal_mask, one_graph_fits, penalised, seen_at, views_of
from .accept import draw, greedy_verdict_on_device, sampling_verdict_on_device
from .chain import next_cap
from .drafts import Cycle
from .graphtree import TreeShape, tree_cycle
from .ngram import NgramLookup

__all__ = ["GraphCycles", "graph_cycles"]


def _draft(shallow, head, cache, token, context, width: int, keys: int, dtype, warp):
    """A cycle's drafts: x [1, 1] and `width` drafts through layers 0..E, each the draft head's argmax (greedy,
    `warp` None) or drawn from its distribution after `warp` (the call's processors) -> (the layer-E states
    [1, width + 1, H], the drafts [1, width], the distributions they were drawn from [1, width, V] or None)."""
    start = cache.layers[0].cumulative_length.clone()
    states, drafts, drawn_from = [], [], []
    for i in range(width + 1):
        positions = (start + i).view(1)
        hidden = shallow(input_ids=token, position_ids=positions[None],
                         attention_mask=causal_mask(positions, keys, dtype), past_key_values=cache,
                         use_cache=True).last_hidden_state
        states.append(hidden)
        if i < width:
            logits, context = head(hidden[:, -1], context)
            if warp is None:
                token = logits.argmax(-1, keepdim=True)
            else:
                drawn_from.append(warp(logits.float()).softmax(-1))
                token = draw(drawn_from[-1])
            drafts.append(token)
    drafts = torch.cat(drafts, 1) if drafts else token.new_zeros(1, 0)
    return torch.cat(states, 1), drafts, torch.stack(drawn_from, 1) if drawn_from else None


def _given(shallow, cache, ids, keys: int, dtype, warp):
    """A cycle's drafts given by the host (an n-gram continuation): x and them, ids [1, k + 1], through layers 0..E
    in one pass -> (the layer-E states [1, k + 1, H], the drafts [1, k], sampling: distributions certain of each
    draft [1, k, V], else None)."""
    positions = cache.layers[0].cumulative_length + torch.arange(ids.shape[1], device=ids.device)
    states = shallow(input_ids=ids, position_ids=positions[None],
                     attention_mask=causal_mask(positions, keys, dtype), past_key_values=cache,
                     use_cache=True).last_hidden_state
    drafts = ids[:, 1:]
    return states, drafts, None if warp is None else _certain(drafts, warp.vocab)


def _certain(drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(drafts, vocab).float()


def _verify(deep, offset, logits_from_normed, cache, states, drafts, keys: int, first_deep: int, suppress, warp,
            drawn_from, valid, penalty=None):
    """A cycle's verification: layers E+1..L-1 over [x, drafts] from their layer-E `states` [1, k + 1, H]; the
    tokens to emit, the accepted count, the next context, and every cache layer cut back to the accepted path
    -> (tokens [1, k + 1], of which the first accepted + 1 are emitted; accepted []; context [1, H]).
    `suppress`: (where [k + 1] bool, tokens [V] bool): the tokens whose scores are -inf at those positions (a
    minimum length's end-of-sequence tokens). `valid` []: how many of the drafts count (the rest pad a shorter
    n-gram continuation to the graph's width; never accepted). `penalty`: (p [], seen [V] bool) for a repetition
    penalty, the tokens up to x seen; each position also sees the drafts before it. Greedy (`warp` None): the
    longest prefix of drafts equal to the full model's argmax, then its token. Sampling: the speculative-sampling
    rule (`accept.py`) on the full model's distributions after `warp` and the drafts' `drawn_from` [1, k, V]."""
    width = drafts.shape[1]
    positions = cache.layers[first_deep].cumulative_length + torch.arange(width + 1, device=states.device)
    if offset is not None:
        states = states - offset(inputs_embeds=torch.zeros_like(states), position_ids=positions[None],
                                 use_cache=False).last_hidden_state
    normed = deep(inputs_embeds=states, position_ids=positions[None],
                  attention_mask=causal_mask(positions, keys, states.dtype), past_key_values=cache,
                  use_cache=True).last_hidden_state
    logits = logits_from_normed(normed)
    where, suppressed = suppress
    logits = logits.masked_fill(where[None, :, None] & suppressed, float("-inf"))
    if penalty is not None:
        logits = penalised(logits.float(), penalty[0], seen_at(penalty[1], drafts[0]))
    counts = torch.arange(width, device=states.device) < valid  # [k]
    if warp is None:
        tokens, accepted = greedy_verdict_on_device(logits, drafts, counts)
    else:
        tokens, accepted = sampling_verdict_on_device(warp(logits[0].float()).softmax(-1), drafts[0], drawn_from,
                                                      counts)
    context = normed[0].index_select(0, accepted.view(1))
    for layer in cache.layers:
        layer.cumulative_length.sub_(width - accepted)
    return tokens, accepted, context


def _cycle(shallow, head, deep, offset, logits_from_normed, cache, token, context, width: int, dtype,
           first_deep: int, suppress, warp, given, valid, penalty=None):
    """One cycle, drafts (from the head, or `given` [1, k] by the host, of which the first `valid` count) and
    verification, as one graph ->
    (accepted count then the k + 1 tokens of which the first accepted + 1 are emitted [k + 2]: what the host
    reads; the next cycle's token x [1, 1]; its context [1, H]). The cache's length is read from its tensors, a
    dynamic dimension of the graph (`cachepool.dynamic_length`): one graph for every cache length."""
    keys = slots(cache)
    if given is None:
        states, drafts, drawn_from = _draft(shallow, head, cache, token, context, width, keys, dtype, warp)
    else:
        states, drafts, drawn_from = _given(shallow, cache, torch.cat([token, given], 1), keys, dtype, warp)
    tokens, accepted, context = _verify(deep, offset, logits_from_normed, cache, states, drafts, keys, first_deep,
                                        suppress, warp, drawn_from, width if given is None else valid, penalty)
    return torch.cat([accepted.view(1), tokens[0]]), tokens.index_select(1, accepted.view(1)), context


def graph_cycles(session, input_ids, generation_config, logits_processor, cache, mask,
                 emitted: Emitted) -> GraphCycles | str:
    """The graph backend for this call, its prompt prefilled, or why the call drafts and verifies instead."""
    parts = session.parts
    processors = GraphProcessors.of(logits_processor, session.model.num_head_rows, input_ids.device,
                                    bool(generation_config.do_sample))
    # a tree the call named (a repo's tree gives way to a chain): the head's candidates for the next position
    tree = session.draft_topk if session.draft_topk > 1 and not session.fused_chain_first else 0
    if processors is None:
        return "logits processors that do not run in the graph"
    if tree and processors.penalty is not None:
        return "a repetition penalty in a tree"
    if emitted.keeps_outputs:
        return "per-token scores or logits asked for"
    if not session.spans.compiled:
        return "eager spans"
    if not session.options.head_drafts:
        return "no drafts from the head"
    if not parts.uniform_layers:
        return "layers that do not all take one set of arguments"
    if not one_graph_fits(parts, cache, mask):
        return "a model, cache or padding the graph does not fit (`graphparts.one_graph_fits`)"
    if input_ids.shape[1] < 2:
        return "a one-token prompt"
    session.verifier.prefill(input_ids)  # the cache holds all but the last token; the context
    if not all(layer.is_initialized for layer in cache.layers):
        return "a cache layer the prompt did not initialise"
    head = session.model.draft_function(session.draft_layer, session.options.draft_vocab_size)
    if head is None:
        return "no draft function at the draft layer"
    views = views_of(session.model, parts, (0, session.draft_layer + 1, parts.num_layers), (False, True))
    if views is None:
        return "a backbone that does not fit views (`graphparts.views_of`)"
    (shallow, deep), offset = views
    return GraphCycles(session, input_ids, head, cache, shallow, deep, offset, processors, tree)


class GraphCycles:
    """The graph backend: a lossless cycle of one call as one compiled graph and one host read."""

    def __init__(self, session, input_ids, head, cache, shallow, deep, offset, processors: GraphProcessors,
                 tree: int = 0):
        self.session, self.head, self.cache, self.processors = session, head, cache, processors
        self.shallow, self.deep, self.offset = shallow, deep, offset
        self.keys = cache.layers[0].max_cache_len
        dynamic_length(cache)  # (one graph for every cache length)
        self.tree = tree  # a tree's candidates for the next position (0: a chain)
        self.cap = session.options.max_draft  # the longest chain the head drafts next (`chain.next_cap`)
        self.dtype = next(session.parts.layers[0].parameters()).dtype
        # the last token (laid out afresh, as every later one: one graph) and the context the prefill left
        self.token, self.context = dense(input_ids[:, -1:]), session.context
        tokens = input_ids[0].tolist()
        self.ngrams = NgramLookup(session.options.draft_ngram) if session.options.draft_ngram else None
        if self.ngrams:
            self.ngrams.extend(tokens)
        self.seen = processors.seen(tokens, input_ids.device)

    def cycle(self, input_ids) -> Cycle:
        """The cycle after `input_ids` [1, n], whose last token the previous cycle's graph gave (its K/V not yet in
        the cache)."""
        session, length = self.session, input_ids.shape[1]
        # (the cache Tide lends a compiled call has room for a full draft after the last token: tokens past the
        # length limit are computed and dropped, and no graph is made for a narrower width near the end)
        room = self.keys - length
        continuation = self.ngrams.continuation(session.options.max_draft) if self.ngrams else []
        start = time.perf_counter()
        read, self.token, self.context, width, continuation, tree = self._graph(continuation, room, length)
        read = read.tolist()  # the cycle's one host read
        graph_s = time.perf_counter() - start
        accepted, new = read[0], read[1: read[0] + 2]
        tokens = torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)
        if self.ngrams:  # (what the loop keeps: all of them, unless the call ends in this cycle)
            self.ngrams.extend(new)
        if self.seen is not None:
            self.seen[tokens[0]] = True
        if not (tree or continuation):  # (n-gram drafts leave the head's cap; a tree has none)
            self.cap = next_cap(self.cap, width, accepted, session.options.max_draft)
        # (a tree: the n-gram tokens accepted are those of the path that emitted the continuation's tokens)
        through = min(accepted, len(continuation)) if not tree or new[:accepted] == continuation[:accepted] else 0
        return Cycle(tokens, accepted, (self.tree + len(continuation)) if tree else (len(continuation) or width),
                     self.tree or 1,
                     ngram_drafted=len(continuation), ngram_accepted=through if continuation else 0, tree=tree,
                     merged=bool(tree and continuation),
                     layer_passes=(session.draft_layer + 1) * width + session.parts.num_layers, graph_s=graph_s,
                     read=new)

    def _graph(self, continuation: list[int], room: int, length: int):
        """One cycle's graph call: the call's tree where it names one and the cache has room (the n-gram branch where
        there is a `continuation`, padded to one width: two graphs), else a chain (the continuation padded to one
        width, or the head's drafts up to the cap) -> (what the host reads, the next token, the next context, the
        chain's width, the continuation drafted, whether it was a tree)."""
        session, cache, device, dtype = self.session, self.cache, self.token.device, self.dtype
        common = (self.shallow, self.head, self.deep, self.offset, session.parts.logits_from_normed, cache,
                  self.token, self.context)
        shape = self.tree and TreeShape(self.tree, session.options.max_draft if continuation else 0)
        if shape and room >= shape.size - 1:
            given = (torch.tensor([continuation + continuation[-1:] * (shape.ngram - len(continuation))],
                                  device=device) if continuation else None)
            return (*session.spans.graph(
                ("tree", *shape.key(), self.processors.warp is not None), tree_cycle,
                "tide_tree_{}_{}".format(*shape.key()) + "_sampled" * (self.processors.warp is not None), *common,
                shape, dtype, self.processors.suppress(length, shape.max_depth), self.processors.warp, given,
                torch.tensor(len(continuation), device=device)), 1, continuation, True)
        if continuation and room >= session.options.max_draft:  # padded to one width: one graph for every continuation
            width, valid = session.options.max_draft, torch.tensor(len(continuation), device=device)
            given = torch.tensor([continuation + continuation[-1:] * (width - len(continuation))], device=device)
        else:
            continuation, given, valid = [], None, None
            width = max(0, min(self.cap, room))
        penalty = None if self.seen is None else (self.processors.penalty, self.seen)
        kind = (width, self.processors.warp is not None, given is not None, penalty is not None)  # one graph each
        return (*session.spans.graph(
            ("cycle", *kind), _cycle, f"tide_cycle_{width}" + "_sampled" * kind[1] + "_given" * kind[2]
            + "_penalised" * kind[3], *common, width, self.dtype, session.draft_layer + 1,
            self.processors.suppress(length, width), self.processors.warp, given, valid, penalty),
            width, continuation, False)
