"""Lossless chains as one compiled graph and one host read a cycle (`tide_config={"compile": True}`).

A cycle of the general loop (`lossless.py`) runs the drafter's compiled calls, captures each pass's layer arguments
on the host, checks each draft against the stopping criteria, reads the accepted count and crops the cache layer
by layer: host work between compiled spans. Here, for chains from the draft head (a full-attention static cache,
one attention type), greedy or sampled, a cycle is one graph (`_cycle`, one per chain width) and one read:

1. **drafts**: the last emitted token x and each of k drafts run through layers 0..E (the draft layer) on the real
   cache, one position a pass; the draft head on each pass's output gives the next draft: its argmax, or a token
   drawn from its distribution after the call's warpers. k follows acceptance as the eager loop's cap does
   (`speculative.next_cap`: one more after a full accept, the accepted count + 1 after a rejection, up to
   `max_draft`), one graph per width. With `draft_ngram`, where the sequence's latest n-gram occurred before, its
   continuation (the host knows it) gives the first drafts of a chain of `max_draft`, in that width's graph: no graph
   of its own. The backbone's own forward does the work, on a view of it that holds layers 0..E and no final norm
   (`graphparts.backbone_view`), so positions, rotary tables and masks are made inside the graph as the model makes
   them. (A fixed width, one graph, drafts more after rejections: docs/benchmarks.md weighs the two.)
2. **verification**: layers E+1..L-1 over [x, d1..dk] from their layer-E states (a view that starts at layer E+1
   and ends with the final norm), the head, a minimum length's end-of-sequence scores set to -inf, acceptance
   (greedy: the longest prefix of drafts equal to the full model's argmax; sampling: the speculative-sampling rule,
   its uniform draws and the token after the path drawn on the device), the next cycle's token and context, and
   every cache layer's length cut back to the accepted path. Positions come from the static cache's own length
   tensors, so no graph is made again for another prompt length.
3. **one host read**: the accepted count and the tokens, for the stopping criteria, the streamer and the sequence.

A call that names `draft_topk` runs a tree instead, one graph a cycle too, greedy or sampled (`fusedtree.py`).

The processors that run in the graph are generate's minimum length, the repetition penalty (on the tokens seen so
far: a mask of the vocabulary the loop keeps on the device, and in the graph each drafted position's drafts before
it) and, sampling, the warpers that read the scores alone (temperature, top-k, top-p, min-p); a call with any other
takes the general loop. Drafted tokens that would stop generation are not cut before verification (the emitted
tokens are the full model's, whatever was drafted); the stopping criteria run on the emitted tokens, one at a time,
and the tokens after the first that stops are dropped with their K/V. The deep view takes the layer-E states as its
input embeddings; what the backbone adds to its inputs before layer 0 (learned positions) is measured once and taken
off (`graphparts.input_offset`), and a backbone that transforms them otherwise (e.g. scales them) is not used.
"""

from __future__ import annotations

import time

import torch
from ..layers.spans import dense
from ..models.compat import crop_cache
from .accept import draw, greedy_verdict_on_device, sampling_verdict_on_device
from .emit import Emitted
from .cachepool import dynamic_length, slots
from .fusedtree import TreeShape, tree_cycle
from .graphparts import GraphProcessors, Stops, causal_mask, one_graph_fits, penalised, seen_at, views_of
from .ngram import NgramLookup
from .speculative import next_cap

__all__ = ["FusedChain", "fused_chain_for"]


def _draft(shallow, head, cache, token, context, given, ngram, width: int, keys: int, dtype, warp):
    """A cycle's `width` drafts: x [1, 1] and each draft through layers 0..E, one position a pass; draft i is the
    host's n-gram continuation `given` [1, width] where i < `ngram` [], else the draft head's argmax (greedy, `warp`
    None) or a token drawn from its distribution after `warp` (the call's processors) -> (the layer-E states
    [1, width + 1, H], the drafts [1, width], sampling: the distributions they were drawn from [1, width, V] (an
    n-gram draft's certain of its token), else None)."""
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
            from_ngram = ngram > i
            if warp is None:
                token = torch.where(from_ngram, given[:, i: i + 1], logits.argmax(-1, keepdim=True))
            else:
                distribution = warp(logits.float()).softmax(-1)
                certain = torch.nn.functional.one_hot(given[:, i], warp.vocab).to(distribution.dtype)
                drawn_from.append(torch.where(from_ngram, certain, distribution))
                token = torch.where(from_ngram, given[:, i: i + 1], draw(distribution))
            drafts.append(token)
    drafts = torch.cat(drafts, 1) if drafts else token.new_zeros(1, 0)
    return torch.cat(states, 1), drafts, torch.stack(drawn_from, 1) if drawn_from else None


def _verify(deep, offset, logits_from_normed, cache, states, drafts, keys: int, first_deep: int, suppress, warp,
            drawn_from, penalty=None):
    """A cycle's verification: layers E+1..L-1 over [x, drafts] from their layer-E `states` [1, k + 1, H]; the
    tokens to emit, the accepted count, the next context, and every cache layer cut back to the accepted path
    -> (tokens [1, k + 1], of which the first accepted + 1 are emitted; accepted []; context [1, H]).
    `suppress`: (where [k + 1] bool, tokens [V] bool): the tokens whose scores are -inf at those positions (a
    minimum length's end-of-sequence tokens). `penalty`: (p [], seen [V] bool) for a repetition penalty, the tokens
    up to x seen; each position also sees the drafts before it. Acceptance is `accept.py`'s, on the device: greedy
    (`warp` None), the longest prefix of drafts equal to the full model's argmax, then its token; sampling, the
    speculative-sampling rule on the full model's distributions after `warp` and the drafts' `drawn_from`
    [1, k, V]."""
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
    if warp is None:
        tokens, accepted = greedy_verdict_on_device(logits, drafts)
    else:
        tokens, accepted = sampling_verdict_on_device(warp(logits[0].float()).softmax(-1), drafts[0], drawn_from)
    context = normed[0].index_select(0, accepted.view(1))
    for layer in cache.layers:
        layer.cumulative_length.sub_(width - accepted)
    return tokens, accepted, context


def _cycle(shallow, head, deep, offset, logits_from_normed, cache, token, context, given, ngram, width: int, dtype,
           first_deep: int, suppress, warp, penalty=None):
    """One cycle, `width` drafts (the first `ngram` [] the host's n-gram continuation `given` [1, width], the rest
    the head's) and their verification, as one graph ->
    (accepted count then the k + 1 tokens of which the first accepted + 1 are emitted [k + 2]: what the host
    reads; the next cycle's token x [1, 1]; its context [1, H]). The cache's length is read from its tensors, a
    dynamic dimension of the graph (`cachepool.dynamic_length`): one graph for every cache length."""
    keys = slots(cache)
    states, drafts, drawn_from = _draft(shallow, head, cache, token, context, given, ngram, width, keys, dtype, warp)
    tokens, accepted, context = _verify(deep, offset, logits_from_normed, cache, states, drafts, keys, first_deep,
                                        suppress, warp, drawn_from, penalty)
    return torch.cat([accepted.view(1), tokens[0]]), tokens.index_select(1, accepted.view(1)), context


def fused_chain_for(session, input_ids, generation_config, logits_processor, cache, mask,
                    emitted: Emitted) -> FusedChain | None:
    """The fused chain for this call, its prompt prefilled, or None where the call takes the general loop: logits
    processors that do not run in the graph, per-token outputs, eager spans, a cache that is not full-attention
    static, padding in the prompt, a one-token prompt, attention that does not add a mask, a model whose layers do
    not all take one set of arguments or whose backbone does not fit a view."""
    parts = session.parts
    processors = GraphProcessors.of(logits_processor, session.model.num_head_rows, input_ids.device,
                                bool(generation_config.do_sample))
    # a tree the call named (a repo's tree gives way to a chain): the head's candidates for the next position
    tree = session.draft_topk if session.draft_topk > 1 and not session.fused_chain_first else 0
    if (processors is None or (tree and processors.penalty is not None) or emitted.keeps_outputs
            or not session.spans.compiled
            or not session.head_drafts or not parts.uniform_layers or not one_graph_fits(parts, cache, mask)
            or input_ids.shape[1] < 2):
        return None
    session.verifier.prefill(input_ids)  # the cache holds all but the last token; the context
    if not all(layer.is_initialized for layer in cache.layers):
        return None
    head = session.model.draft_function(session.draft_layer, session.draft_vocab_size)
    if head is None:
        return None
    views = views_of(session.model, parts, (0, session.draft_layer + 1, parts.num_layers), (False, True))
    if views is None:
        return None
    (shallow, deep), offset = views
    return FusedChain(session, head, cache, shallow, deep, offset, processors, tree)


class FusedChain:
    """Runs the lossless cycles of one call as one compiled graph and one host read each."""

    def __init__(self, session, head, cache, shallow, deep, offset, processors: GraphProcessors, tree: int = 0):
        self.session, self.head, self.cache, self.processors = session, head, cache, processors
        self.ngrams = NgramLookup(session.draft_ngram) if session.draft_ngram else None
        self.shallow, self.deep, self.offset = shallow, deep, offset
        self.keys = cache.layers[0].max_cache_len
        dynamic_length(cache)  # (one graph for every cache length)
        self.cap = session.max_draft  # the longest chain the head drafts next (`speculative.next_cap`)
        self.tree = tree  # a tree's candidates for the next position (0: a chain)

    def decode(self, input_ids, stopping_criteria, generation_config, emitted: Emitted):
        """Generate from `input_ids` [1, n] until a stopping criterion fires; returns what `generate` returns."""
        session, cache, stats = self.session, self.cache, self.session.stats
        stops = Stops(stopping_criteria, generation_config, input_ids.device)
        tokens, context = input_ids[0].tolist(), session.context
        token = dense(input_ids[:, -1:])  # (laid out afresh, as every later token: one graph)
        cached = len(tokens) - 1  # the cache's length, followed here (reading the device's would be a sync)
        dtype = next(session.parts.layers[0].parameters()).dtype
        if self.ngrams:
            self.ngrams.extend(tokens)
        self.seen = self.processors.seen(tokens, input_ids.device)
        while True:
            start = time.perf_counter()
            # (the cache Tide lends a compiled call has room for a full draft after the last token: tokens past
            # the length limit are computed and dropped, and no graph is made for a narrower width near the end)
            room = self.keys - cached - 1
            continuation = self.ngrams.continuation(session.max_draft) if self.ngrams else []
            graph_start = time.perf_counter()
            read, token, context, width, continuation, tree = self._graph(token, context, continuation, room,
                                                                          len(tokens), dtype)
            read = read.tolist()  # the cycle's one host read
            graph_s = time.perf_counter() - graph_start
            accepted, new = read[0], read[1: read[0] + 2]
            kept, done = stops.emitted(tokens, new)
            tokens += new[:kept]
            if self.ngrams:
                self.ngrams.extend(new[:kept])
            if not (tree or continuation):  # (n-gram cycles leave the head's cap; a tree has none)
                self.cap = next_cap(self.cap, width, accepted, session.max_draft)
            cached += accepted + 1
            new_ids = torch.tensor([new[:kept]], dtype=input_ids.dtype, device=input_ids.device)
            emitted.add(new_ids, None, None)
            if self.seen is not None:
                self.seen[new_ids[0]] = True
            # (a tree: the n-gram tokens accepted are those of the path that emitted the continuation's tokens)
            through = min(accepted, len(continuation)) if not tree or new[:accepted] == continuation[:accepted] else 0
            stats.record_cycle(  # (accepted: emitted ones; tokens past a stop are computed and dropped)
                (self.tree + len(continuation)) if tree else width, min(accepted, kept), kept,
                time.perf_counter() - start, draft_topk=self.tree or 1, ngram_drafted=len(continuation),
                ngram_accepted=min(through, kept) if continuation else 0, tree=tree, merged=bool(tree and continuation),
                layer_passes=(session.draft_layer + 1) * width + session.parts.num_layers, graph_s=graph_s)
            if done:
                crop_cache(cache, accepted + 1 - kept)  # the K/V of tokens after the one that stopped
                sequences = torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)
                return emitted.finish(sequences, cache)

    def _graph(self, token, context, continuation: list[int], room: int, length: int, dtype):
        """One cycle's graph call: the call's tree where it names one and the cache has room (the n-gram branch where
        there is a `continuation`, padded to one width: two graphs), else a chain: of the head's drafts up to the
        cap, or, where there is a continuation, of `max_draft` drafts, its tokens first and the head's after them
        (one graph per width the chain takes) -> (what the host reads, the next token, the next context, the
        chain's width, the continuation drafted, whether it was a tree)."""
        session, cache, device = self.session, self.cache, token.device
        common = (self.shallow, self.head, self.deep, self.offset, session.parts.logits_from_normed, cache, token,
                  context)
        shape = self.tree and TreeShape(self.tree, session.max_draft if continuation else 0)
        if shape and room >= shape.size - 1:
            given = (torch.tensor([continuation + continuation[-1:] * (shape.ngram - len(continuation))],
                                  device=device) if continuation else None)
            return (*session.spans.graph(
                ("tree", *shape.key(), self.processors.warp is not None), tree_cycle,
                "tide_tree_{}_{}".format(*shape.key()) + "_sampled" * (self.processors.warp is not None), *common,
                shape, dtype, self.processors.suppress(length, shape.max_depth), self.processors.warp, given,
                torch.tensor(len(continuation), device=device)), 1, continuation, True)
        # (an n-gram continuation rides in the widest chain's graph, its tokens first and the head's after them; the
        # head alone drafts up to the cap)
        width = max(0, min(session.max_draft if continuation else self.cap, room))
        continuation = continuation[:width]
        given = torch.tensor([continuation + [0] * (width - len(continuation))], device=device)
        penalty = None if self.seen is None else (self.processors.penalty, self.seen)
        kind = (width, self.processors.warp is not None, penalty is not None)  # one graph each
        return (*session.spans.graph(
            ("cycle", *kind), _cycle, f"tide_cycle_{width}" + "_sampled" * kind[1] + "_penalised" * kind[2], *common,
            given, torch.tensor(len(continuation), device=device), width, dtype, session.draft_layer + 1,
            self.processors.suppress(length, width), self.processors.warp, penalty), width, continuation, False)
