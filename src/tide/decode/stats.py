"""What a Tide generation actually ran: counts taken from the decode loop, never estimated.

The loops write them through the `record_*` methods here (the passes they run return what they count, and the
loops hand it on); `generation.py` writes what belongs to the call as a whole (its plan, wall time, compiling,
layer-argument captures)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GenerationStats"]


@dataclass
class GenerationStats:
    num_layers: int
    checkpoints: list[int]  # the checkpoints consulted (exit mode: those whose threshold can fire)
    mode: str = "exit"
    kv_strategy: str = "propagate"
    decode_tokens: int = 0  # tokens produced by Tide decode steps (rows x steps)
    decode_steps: int = 0
    exits: dict[str, int] = field(default_factory=dict)  # per checkpoint, plus "full" for no exit
    token_layers: int = 0  # sum over decode tokens of the layers whose output the token used
    layer_passes: int = 0  # batched decoder-layer calls that ran attention + MLP
    kv_only_passes: int = 0  # batched decoder-layer calls that only wrote K/V
    recomputed_positions: int = 0  # stale (row, position, layer) K/V entries rewritten by recompute
    prefill_tokens: int = 0
    prefill_token_layers: int = 0  # with prefill_exit: sum over prompt tokens of the layers they used
    wall_time_s: float = 0.0
    decode_time_s: float = 0.0
    # lossless mode
    drafted: int = 0  # draft steps (a tree's head step offers `draft_topk` candidates for one position) + n-gram tokens
    accepted: int = 0
    verify_passes: int = 0
    draft_topk: int = 1  # 1: chain drafts; k > 1: one-level tree drafts of k candidates
    draft_vocab_size: int = 0  # > 0: drafts ranked only that many most-predicted tokens (0: the whole vocabulary)
    ngram_drafted: int = 0  # of `drafted`: n-gram continuations (`draft_ngram`)
    ngram_accepted: int = 0  # of `accepted`: n-gram continuations
    merged_cycles: int = 0  # tree cycles whose tree held an n-gram branch besides the head's candidates
    tree_cycles: int = 0  # verification passes over a tree (the others verified a chain: a fallback)
    later_children_accepted: int = 0  # accepted tree nodes that were not their parent's first child (at x: the
    #   head's top candidate): the head's lower candidates, an n-gram branch beside them (trees drafted and verified;
    #   fused cycles do not count them)
    # layer arguments: backbone captures Tide's passes ran (`layers/args.py`: one per window of positions where
    # windows hold, else one per pass), and why windows did not hold (None: they did, or were never asked)
    arg_captures: int = 0
    arg_windows_off: str | None = None
    # compiled greedy chains (`lossless/graph.py`): cycles run as one graph and one host read each
    fused_cycles: int = 0
    fused_graph_s: float = 0.0  # of `decode_time_s`: inside those graphs (their launch, guards and host read too)
    # compile=True: torch.compile's work during the call (`models.compat.CompileWatch`): seconds spent compiling (in
    #   `wall_time_s`), graphs compiled, and of those recompilations (a graph made again: its guards failed)
    compiled: bool = False
    compile_s: float = 0.0
    graphs_compiled: int = 0
    recompiles: int = 0
    # the engine switches the call ran with (`TideGenerationConfig.switches`: row_skipping, kernels, kv_fill,
    # few_row_layout); empty where the base model's own decode ran
    switches: dict = field(default_factory=dict)
    plan: str | None = None  # why the call ran what it ran (`decode.plan.CallPlan.reason`)

    @classmethod
    def base_run(cls, num_layers: int, rows: int, prompt_tokens: int, new_tokens: int) -> "GenerationStats":
        """The stats of a call that ran the base model's own `generate` (mode "base"): `rows` sequences of
        `prompt_tokens` continued by `new_tokens`, the first from the prompt's pass, every later one a step that ran
        every layer. Its time is the call's wall time alone."""
        steps = max(new_tokens - 1, 0)
        stats = cls(num_layers=num_layers, checkpoints=[], mode="base", prefill_tokens=rows * prompt_tokens)
        stats.decode_steps, stats.layer_passes = steps, steps * num_layers
        if steps:
            stats.record_exits([num_layers - 1] * (rows * steps))
        return stats

    def record_cycle(self, drafted: int, accepted: int, tokens: int, seconds: float, *, draft_topk: int = 1,
                     ngram_drafted: int = 0, ngram_accepted: int = 0, tree: bool = False, merged: bool = False,
                     later_children: int = 0, layer_passes: int = 0, graph_s: float | None = None) -> None:
        """Count one lossless cycle: `drafted` draft steps and n-gram tokens offered (`ngram_drafted` of them
        n-gram tokens), `accepted` of them emitted (`ngram_accepted` from n-grams), `tokens` emitted in all, one
        verification pass (over a tree where `tree`: one with an n-gram branch where `merged`; `later_children`
        accepted nodes that were not their parent's first child), the draft scheme it ran (`draft_topk`), its
        `layer_passes` where the loop knows them a cycle, its `seconds` and, a cycle run as one graph, the seconds
        inside it (`graph_s`)."""
        self.drafted += drafted
        self.ngram_drafted += ngram_drafted
        self.accepted += accepted
        self.ngram_accepted += ngram_accepted
        self.decode_tokens += tokens
        self.verify_passes += 1
        self.decode_steps += 1
        self.tree_cycles += tree
        self.merged_cycles += merged
        self.later_children_accepted += later_children
        self.layer_passes += layer_passes
        if graph_s is not None:
            self.fused_cycles += 1
            self.fused_graph_s += graph_s
        self.draft_topk = draft_topk
        self.decode_time_s += seconds

    def record_passes(self, layer_passes: int, prefill_tokens: int = 0, prefill_token_layers: int = 0) -> None:
        """Count layer calls and prompt tokens a call's passes ran outside what its cycles or steps counted."""
        self.layer_passes += layer_passes
        self.prefill_tokens += prefill_tokens
        self.prefill_token_layers += prefill_token_layers

    def record_base_step(self, rows: int) -> None:
        """Count one step of the base model's own decode: `rows` tokens, each through every layer."""
        self.decode_steps += 1
        self.decode_tokens += rows
        self.token_layers += rows * self.num_layers

    def record_time(self, seconds: float) -> None:
        """Count decode time spent outside the steps' records (an exit-mode step's around its walk)."""
        self.decode_time_s += seconds

    def record_step(self, exit_layers: list[int], full_passes: int, kv_only_passes: int, recomputed: int = 0,
                    seconds: float = 0.0) -> None:
        """Count one exit-mode decode step: where its tokens left, the layer work it ran and its `seconds`."""
        self.decode_time_s += seconds
        self.decode_steps += 1
        self.layer_passes += full_passes
        self.kv_only_passes += kv_only_passes
        self.recomputed_positions += recomputed
        self.record_exits(exit_layers)

    def record_exits(self, exit_layers: list[int]) -> None:
        """Count where emitted tokens left the stack."""
        for k in exit_layers:
            key = "full" if k >= self.num_layers - 1 else str(k)
            self.exits[key] = self.exits.get(key, 0) + 1
            self.token_layers += k + 1
        self.decode_tokens += len(exit_layers)

    @property
    def mean_layers(self) -> float:
        """Mean layers whose output a decode token used (its exit depth)."""
        return self.token_layers / self.decode_tokens if self.decode_tokens else float("nan")

    @property
    def layer_passes_per_token(self) -> float:
        """Batched decoder-layer calls per emitted token (lossless: drafting, recompute and verification)."""
        return self.layer_passes / self.decode_tokens if self.decode_tokens else float("nan")

    @property
    def layers_skipped(self) -> int:
        """Batched decoder-layer calls that did not run attention + MLP, over all decode steps."""
        return self.decode_steps * self.num_layers - self.layer_passes

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time_s if self.decode_time_s else float("nan")

    @property
    def fused_host_share(self) -> float:
        """Of the fused cycles' decode time, the share spent outside their graphs (drafting n-grams, stopping
        criteria, the streamer, stats): the host's work a cycle."""
        return 1.0 - self.fused_graph_s / self.decode_time_s if self.decode_time_s else float("nan")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items()}
        out.update(mean_layers=self.mean_layers, layers_skipped=self.layers_skipped, tokens_per_s=self.tokens_per_s)
        if self.mode == "lossless":
            out["acceptance_rate"] = self.acceptance_rate
        return out

    def summary(self) -> str:
        """A readable table of the run."""
        rows = [("plan", self.plan)] if self.plan else []
        if self.mode == "base":
            return _table(rows + [
                ("mode", "base (the base model's own generate: every token ran every layer)"),
                ("decode tokens", f"{self.decode_tokens} in {self.decode_steps} steps"),
                ("wall time", f"{self.wall_time_s:.3f} s"),
            ])
        rows += [
            ("mode / kv strategy", f"{self.mode} / {self.kv_strategy}"),
            ("decode tokens", f"{self.decode_tokens} in {self.decode_steps} steps"),
        ]
        if self.mode == "lossless":
            rows += [
                ("draft scheme", (f"tree of {self.draft_topk} candidates" if self.draft_topk > 1 else "chain")
                 + (f", over the {self.draft_vocab_size} most predicted tokens" if self.draft_vocab_size else "")),
                ("drafted / accepted", f"{self.drafted} / {self.accepted} ({self.acceptance_rate:.1%})"
                 + (f"; n-gram drafts {self.ngram_drafted} / {self.ngram_accepted}" if self.ngram_drafted else "")
                 + (f"; {self.merged_cycles} merged trees" if self.merged_cycles else "")),
                ("verification passes", str(self.verify_passes) + self._trees_text()),
                ("layer passes per token", f"{self.layer_passes_per_token:.2f} (the base model: {self.num_layers})"),
            ]
            if self.fused_cycles:
                rows.append(("fused cycles", f"{self.fused_cycles} (one compiled graph and one host read each; "
                             f"{self.fused_host_share:.0%} of the decode time outside the graphs)"))
        else:
            rows += [
                ("mean layers per token", f"{self.mean_layers:.2f} of {self.num_layers}"),
                ("layer passes (attn+MLP)", f"{self.layer_passes} of {self.decode_steps * self.num_layers}"),
                ("layers skipped", str(self.layers_skipped)),
            ]
        rows.append(("KV-only layer passes", str(self.kv_only_passes)))
        if self.kv_strategy == "recompute":
            rows.append(("recomputed K/V entries", str(self.recomputed_positions)))
        if self.compiled:
            rows.append(("compiling", self.compile_text()))
        rows += [
            ("wall time", f"{self.wall_time_s:.3f} s (decode {self.decode_time_s:.3f} s)"),
            ("decode tokens/s", f"{self.tokens_per_s:.1f}"),
        ]
        if self.switches:
            rows.append(("switches", ", ".join(f"{k}={v}" for k, v in self.switches.items())))
        checkpoints = ", ".join(map(str, self.checkpoints)) or "none"
        if self.mode == "lossless":  # (every token is the full model's: no exits to count)
            rows.append(("draft layer", checkpoints))
        else:
            rows.append(("checkpoints consulted", checkpoints))
            total = max(sum(self.exits.values()), 1)
            for key in [str(k) for k in self.checkpoints if self.exits.get(str(k))] + ["full"]:
                n = self.exits.get(key, 0)
                label = f"exits after layer {key}" if key != "full" else "ran all layers"
                rows.append((label, f"{n} ({n / total:.1%})"))
        return _table(rows)

    def compile_text(self) -> str:
        """The call's compiling in words: seconds, graphs compiled, recompiles."""
        return (f"{self.compile_s:.1f} s, {self.graphs_compiled} graph{'s' * (self.graphs_compiled != 1)} compiled, "
                f"{self.recompiles} recompile{'s' * (self.recompiles != 1)}")

    def _trees_text(self) -> str:
        """How many verification passes were over trees, and (drafted and verified) the accepted later children."""
        if not self.tree_cycles:
            return ""
        later = "" if self.fused_cycles else (f"; {self.later_children_accepted} accepted nodes not their parent's "
                                              "first child")
        return f" ({self.tree_cycles} over trees{later})"

    def __str__(self) -> str:
        return self.summary()


def _table(rows: list[tuple[str, str]]) -> str:
    """Rows of (name, value) as aligned lines."""
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
