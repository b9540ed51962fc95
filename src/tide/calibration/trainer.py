"""Training the heads and routers: the first pass streams the training texts, one base forward per batch
(`forward.capture`) into a bounded buffer, with the exit and draft heads' minibatch steps on the way (`train`);
`_Trainer` then copies the heads into the model and trains the routers on labels through the trained exits."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from ..heads.draftvocab import candidate_sizes, ranked_vocabulary
from ..modeling import TideForCausalLM
from .distributed import Processes
from .forward import Capture, WeightsIn, capture, head_chunk, label_of, stream_dtype
from .headloss import TEACHER_TOP, Candidates, draw_negatives, head_kl, uses_candidates
from .heldout import ranked_draft_vocabulary
from .options import CalibrationOptions
from .phases import Context
from .rankedrows import RankedRows
from .texts import batches, stream_size

__all__ = ["train", "HEAD_PASSES", "HEAD_STEPS"]


def train(ctx: Context, train_texts: list[str], bar) -> tuple["_Trainer", torch.Tensor | None]:
    """Stream this process's training texts (`bar` counts them): exit heads, draft heads, then routers. (The
    trainer, the ranked draft vocabulary or None: `heldout.ranked_draft_vocabulary`.)"""
    tide, opts, procs, phases = ctx.tide, ctx.opts, ctx.procs, ctx.phases
    rows, tokens = stream_size(train_texts, ctx.tokenizer, opts.max_length)
    local_batches = math.ceil(rows / opts.batch_size)
    num_batches = procs.max_int(local_batches)  # every process takes the same steps, in step
    feature_dtype = procs.on_main(lambda: stream_dtype(tide, opts.feature_dtype))  # one choice for all
    trainer = _Trainer(tide, opts, num_batches=num_batches, procs=procs,
                       train_tokens=procs.max_int(tokens) * procs.world, feature_dtype=feature_dtype)
    reading = WeightsIn(tide.base, feature_dtype)  # the base forward's dtype (the heads train in float32)
    for batch in phases.counted("data", batches(train_texts, ctx.tokenizer, opts, tide.base.device)):
        with phases("training"):
            with reading():
                cap = capture(tide, batch, top=trainer.candidates)
            trainer.add(cap)
        bar.update(batch["texts"])
        bar.set_postfix(kl=f"{trainer.last_kl:.3f}")
    with phases("training"):
        for _ in range(num_batches - local_batches):
            trainer.add(None)
        trainer.finish()
        ranked = ranked_draft_vocabulary(tide, trainer, procs)
    return trainer, ranked


# The heads' default Adam steps, by loss: {candidates: steps}. A candidate step costs a fraction of a step over the
# whole vocabulary, and on SmolLM2-135M-Instruct 1,000 of them raised draft acceptance at layer 3 from 36% to 47%
# over 200 (docs/benchmarks.md). A longer stream takes more: HEAD_PASSES[loss] minibatches' rows a training token.
# Over candidates, 3: the base forward that makes a token's states costs far more than a step over it, and on
# SmolLM2-135M-Instruct's ShareGPT answers a draft head that read each token several times learned more (layer 3's
# held-out first drafts 0.369 right after 1,000 steps over 131k tokens, 2 passes; 0.392 after 2,048, 0.403 after
# 4,000: docs/benchmarks.md, "The draft heads' passes over their tokens"); 3 keeps calibration at the defaults
# within 10 minutes there. Over the whole vocabulary (small vocabularies), half a pass, as before: not measured there.
HEAD_STEPS = {False: 200, True: 1000}
HEAD_PASSES = {False: 0.5, True: 3}


class _Trainer:
    """Exit heads then routers, from a bounded ring buffer of training tokens.

    While the training texts stream, each batch's states enter the buffer and the exit heads (translators) and
    draft heads take Adam steps minimising KL(full model || head) on buffered tokens, `head_steps` in all: exit heads
    over the whole vocabulary or each row's candidates (`headloss`), draft heads over the whole vocabulary or, with
    candidates, over the tokens the full model has predicted most so far, as many as the largest draft vocabulary
    (`draftvocab.MAX_SIZE` at most: what a restricted draft ranks; on SmolLM2-135M-Instruct's answers 0.34-0.35 of
    held-out drafts right, 0.31-0.33 from candidates). A step stacks the exit heads' states, and the draft heads',
    so that each kind takes one product with the head's rows. Then every buffered token is labelled through the
    trained exits (with candidates, the most predicted tokens' head rows are read first: `RankedRows.agreement`) and
    the routers (on fp32 copies) sweep the buffer `passes` times.
    Memory: the buffer, (checkpoints + 2) x buffer_size x H floats.
    """

    def __init__(self, tide: TideForCausalLM, opts: CalibrationOptions, num_batches: int,
                 procs: Processes | None = None, train_tokens: int = 0, feature_dtype: str | None = None):
        self.tide, self.opts, self.parts = tide, opts, tide.parts
        self.procs = procs or Processes()
        self.layers = list(tide.checkpoints)
        hidden = tide.config.base_hidden_size or self.parts.norm.weight.shape[-1]
        size = opts.buffer_size or max(opts.minibatch, min(32768, (1 << 30) // (4 * hidden * (len(self.layers) + 2))))
        size = math.ceil(size / self.procs.world)  # together, the processes' buffers hold what one process's would
        device = tide.base.device
        self.states = {k: torch.empty(size, hidden, device=device) for k in self.layers}
        self.final = torch.empty(size, hidden, device=device)
        self.top1 = torch.empty(size, dtype=torch.long, device=device)
        self.size, self.filled, self.cursor, self.train_tokens, self.head_rows = size, 0, 0, 0, 0
        self.translators = {k: copy.deepcopy(tide.routers[k].translator).float() for k in self.layers
                            if tide.routers[k].translator is not None}
        self.drafts = {k: copy.deepcopy(tide.routers[k].draft).float() for k in self.layers
                       if tide.routers[k].draft is not None}
        self.context = torch.empty(size, hidden, device=device) if self.drafts else None
        self.first = torch.ones(size, dtype=torch.bool, device=device) if self.drafts else None  # a text's first
        self.predicted = torch.zeros(tide.num_head_rows, dtype=torch.long, device=device)  # full-model top-1 counts
        # the candidate loss, else the whole vocabulary
        self.candidates = uses_candidates(tide.num_head_rows, self.parts.head_rows_readable)
        self.top = torch.empty(size, TEACHER_TOP, dtype=torch.long, device=device) if self.candidates else None
        # with the candidate loss, draft heads learn over the tokens the full model has predicted most so far, as
        # many as the largest draft vocabulary (`heads.draftvocab`): they rank only those at generation
        self.draft_rows = max(candidate_sizes(tide.num_head_rows)) if self.candidates and self.drafts else None
        self.draft_head = None  # the head's rows for them (`ModelParts.head_rows`), made again once the counts change
        params = self._head_params()
        self.head_optim = torch.optim.Adam(params, lr=opts.head_lr) if params else None
        steps = opts.head_steps
        if steps is None:
            passes = HEAD_PASSES[self.candidates]
            steps = max(HEAD_STEPS[self.candidates], math.ceil(train_tokens * passes / opts.minibatch))
        self.steps_per_batch = math.ceil(steps / max(num_batches, 1))
        self.head_steps_left = steps if params else 0
        self.generator = torch.Generator(device="cpu").manual_seed(opts.seed)
        self.last_kl = float("nan")
        self.feature_dtype = feature_dtype  # the dtype the stream's forward runs in (None: the model's own)

    def add(self, cap: Capture | None) -> None:
        """Buffer a batch's states (None: no batch left on this process, but take the steps the others take)."""
        if cap is not None:
            self._buffer(cap)
        for _ in range(min(self.steps_per_batch, self.head_steps_left)):
            self._head_step()

    def _buffer(self, cap: Capture) -> None:
        n = min(cap.final.shape[0], self.size)
        idx = ((torch.arange(n) + self.cursor) % self.size).to(self.final.device)
        for k in self.layers:
            self.states[k][idx] = cap.states[k][-n:].float()
        self.final[idx], self.top1[idx] = cap.final[-n:].float(), cap.full_top1[-n:]
        if self.top is not None:
            self.top[idx] = cap.top[-n:]
        self.predicted += torch.bincount(cap.full_top1, minlength=self.predicted.numel())
        self.draft_head = None
        if self.context is not None:
            self.context[idx] = cap.context[-n:].float()
            self.first[idx] = cap.first[-n:]
            # the positions before these two are not in the buffer: the batch's own first, where the batch was cut,
            # and the older token after the batch, whose position before the batch overwrote
            self.first[idx[0]] = self.first[(idx[-1] + 1) % self.size] = True
        self.cursor = (self.cursor + n) % self.size
        self.filled = min(self.filled + n, self.size)
        self.train_tokens += cap.final.shape[0]

    def _pick(self) -> torch.Tensor:
        """This process's share of a minibatch (the gradients are averaged over the processes, so a step still
        learns from `minibatch` tokens in all)."""
        rows = math.ceil(self.opts.minibatch / self.procs.world)
        pick = torch.randint(self.filled, (min(rows, self.filled),), generator=self.generator)
        return pick.to(self.final.device)

    def _logits(self, state: torch.Tensor, tokens: Candidates | tuple | None) -> torch.Tensor:
        """Final norm + head of the model on fp32 states (cast to the model's dtype), over the whole vocabulary, the
        rows' candidates, or some rows of the head (`ModelParts.head_rows`). [..., M, H] -> fp32 [..., M, V],
        [..., M, C] or [..., M, n]."""
        normed = self.parts.final_norm(state.to(self._norm_dtype))
        if isinstance(tokens, Candidates):
            return tokens.logits(self.parts, normed)
        return self.parts.logits_from_normed(normed, tokens).float()

    def _head_step(self) -> None:
        self.head_steps_left -= 1
        pick = self._pick()
        self.head_rows += pick.numel()
        candidates = (Candidates(self.top[pick], draw_negatives(self.predicted, self.generator))
                      if self.candidates else None)
        if self.draft_rows and self.draft_head is None:
            self.draft_head = self.parts.head_rows(ranked_vocabulary(self.predicted, self.draft_rows))
        final = self.final[pick]
        with torch.no_grad():
            teacher = self._logits(final, candidates)  # [M, V] or [M, C]
            draft_teacher = teacher if self.draft_head is None else self._logits(final, self.draft_head)
        # where the stream reads in bfloat16 (a device whose bfloat16 products are fast), the heads' products run in
        # bfloat16 too, under autocast: their weights, gradients and Adam stay float32, the KL is taken in float32
        with torch.enable_grad(), torch.autocast(self.final.device.type, dtype=torch.bfloat16,
                                                 enabled=self.feature_dtype == "bfloat16"):
            # each kind of head's states stacked [heads, M, H]: one product with the head's rows for all of them
            loss = 0.0
            if self.translators:
                exits = torch.stack([t(self.states[k][pick]) for k, t in self.translators.items()])
                loss = loss + len(self.translators) * head_kl(self._logits(exits, candidates), teacher)
            if self.drafts:
                drafts = torch.stack([d(self.states[k][pick], self._draft_context(k, d, pick))
                                      for k, d in self.drafts.items()])
                loss = loss + len(self.drafts) * head_kl(self._logits(drafts, self.draft_head or candidates),
                                                         draft_teacher)
            loss = loss / (len(self.translators) + len(self.drafts))  # the mean of every head's KL
            params = self._head_params()
            grads = torch.autograd.grad(loss, params)  # the base model's own parameters get no .grad
        for p, g in zip(params, grads):
            p.grad = g
        self.procs.mean_grads(params)
        self.head_optim.step()
        self.last_kl = float(loss.detach())

    def _draft_context(self, k: int, draft, pick: torch.Tensor) -> torch.Tensor:
        """The context draft head `k` learns from at the rows `pick` [M, H]: the full model's final normed state at
        the position before, or, for a `training_time_test` share of the rows whose position before is buffered, what
        a chain's later drafts read there instead: the head's own normed state at that position (its draft from
        the verified context; held-out scoring's "chain" drafts)."""
        context = self.context[pick]
        share = self.opts.training_time_test
        if not share:
            return context
        before = (pick - 1) % self.size
        own = ~self.first[pick] & (torch.rand(pick.shape, generator=self.generator) < share).to(pick.device)
        if not own.any():
            return context
        with torch.no_grad():
            rows = before[own]
            drafted = self.parts.final_norm(draft(self.states[k][rows], self.context[rows]).to(self._norm_dtype))
        return context.index_put((own.nonzero().squeeze(-1),), drafted.float())

    @property
    def _norm_dtype(self):
        return self.parts.norm.weight.dtype if hasattr(self.parts.norm, "weight") else torch.float32

    def _head_params(self) -> list:
        return [p for head in [*self.translators.values(), *self.drafts.values()] for p in head.parameters()]

    def finish(self) -> None:
        """Copy the trained exit and draft heads into the model, then train the routers on labels through the exits.

        Each router is trained by one process (checkpoints dealt out in turn) on every process's buffered tokens,
        with no collective per step, and then sent to the others: a router's minibatch steps cost their fixed work,
        not their rows, so splitting rows across processes would not shorten them (with an all-reduce a step, two
        processes took three times as long as one), while splitting the routers divides the phase."""
        with torch.no_grad():
            for heads, name in ((self.translators, "translator"), (self.drafts, "draft")):
                for k, trained in heads.items():
                    target = getattr(self.tide.routers[k], name)
                    for dst, src in zip(target.parameters(), trained.parameters()):
                        dst.copy_(src.to(dst.dtype))
        # on a large vocabulary, the exits' agreement reads the most predicted tokens' head rows first
        vocab = self.predicted.numel()
        rows = (RankedRows.of(self.parts, ranked_vocabulary(self.predicted, max(candidate_sizes(vocab))), vocab)
                if self.candidates else None)
        for i, k in enumerate(self.layers):
            owner = i % self.procs.world
            normed, labels = (self.procs.gather_to(x, owner) for x in self._router_data(k, rows))
            if self.procs.rank == owner:
                self._train_router(k, normed, labels)
        for i, k in enumerate(self.layers):
            router = self.tide.routers[k]
            self.procs.broadcast_tensors([*router.down.parameters(), *router.up.parameters()], src=i % self.procs.world)

    def _router_data(self, k: int, rows: RankedRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The final-norm view of this process's buffered exit states at `k` and their labels through the exit
        (fp32); `rows`: the ranked vocabulary's head rows, read before the whole head (`RankedRows.agreement`)."""
        tide, n, router = self.tide, self.filled, self.tide.routers[k]
        step = head_chunk(tide.num_head_rows)
        with torch.no_grad():
            states, final, top1 = self.states[k][:n].to(router.down.weight.dtype), self.final[:n], self.top1[:n]
            normed, labels = [], []
            for part in range(0, n, step):
                chunk = slice(part, part + step)
                exit_normed = self.parts.final_norm(router.exit_state(states[chunk]))
                normed.append(exit_normed.float())
                if rows is not None:
                    agree = rows.agreement(self.parts, exit_normed, top1[chunk])
                else:
                    agree = self.parts.logits_from_normed(exit_normed).argmax(-1) == top1[chunk]
                labels.append(label_of(agree, states[chunk], final[chunk], tide.config).float())
        return torch.cat(normed), torch.cat(labels)

    def _train_router(self, k: int, normed: torch.Tensor, labels: torch.Tensor) -> None:
        """Router `k`'s Adam steps on (normed, labels): `passes` sweeps in minibatches."""
        router = self.tide.routers[k]
        trained = copy.deepcopy(router).float()
        trained.translator = trained.draft = None
        optim = torch.optim.Adam(trained.parameters(), lr=self.opts.lr)
        n = normed.shape[0]
        with torch.enable_grad():
            for _ in range(self.opts.passes * math.ceil(n / self.opts.minibatch)):
                pick = torch.randint(n, (min(self.opts.minibatch, n),), generator=self.generator).to(normed.device)
                loss = F.binary_cross_entropy_with_logits(trained(normed[pick]), labels[pick])
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
        with torch.no_grad():
            for name in ("down", "up"):
                for dst, src in zip(getattr(router, name).parameters(), getattr(trained, name).parameters()):
                    dst.copy_(src.to(dst.dtype))
