"""The scheduler owns the plan: which sequences run in the next step, and which of their rows (continuous batching).
No thread and no tensor: the driver calls `schedule` and `update` on the model thread, the runner executes the plan.

A sequence's life (sequence.Status):
  waiting   added by the driver, admitted FIFO: a PLACE step puts what its algorithm reuses into its joined cache
            (`linker.plan`: placing, and focus's question pre-pass), for as many arrivals as the step's row budget
            holds of the rows their pre-passes run through the model (one at least; placing's copies are not
            model rows);
  linking   the rows its algorithm recomputes run in pieces of at most the step's row budget (chunked prefill);
            a Narrowing algorithm (cacheblend) runs them in a NARROW step of its own instead, since it chooses its
            rows after a layer over all of them. PLACE and NARROW steps take turns with the running sequences'
            forward steps (and with each other while both wait), so neither arrivals coming faster than steps nor
            narrowing links placed together keep a decoding stream waiting more than one step;
  decoding  after its last link row: one row per step, the token sampled from the step's logits;
  over      finished, failed or aborted: it leaves, and the driver frees its cache before its last event.

Each forward step packs the rows of every running sequence: decode rows first (with the repair rows of those that
asked for repair, Sequence.repair: as many repairs as the row budget holds, by turns), then link pieces, the fewest
pending rows first, until the budget is spent. A short request that arrives behind a long link has its first token
after one budgeted step, not after the whole link; a link passed over MAX_PASSED_OVER steps in a row goes first in
the next (the longest passed over first, so with k such links at once the last waits up to MAX_PASSED_OVER + k - 1
steps), so a stream of short ones (or of chunk compiles, all one chunk long) never starves a long one. A chunk's
compile is a link too (Sequence.compile): its rows pack with the others', each piece attending only to its own
cache, and its last piece's step makes its entry. A task (Sequence.task) runs alone in a TASK step, in the order
tasks came, by turns with the requests' steps. Rows that need the base model's weights (a compile on an adapted
model, a background link) run in steps of their own, taking turns with the others while both wait. A sequence that
fails fails alone; the others go on.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from ..settings import DEFAULT_ROW_BUDGET
from .sequence import Output, Repair, Sequence, Status


class Kind(enum.Enum):
    PLACE = "place"  # linker.plan: the reused rows into the sequence's cache (runs the model for focus's pre-pass)
    NARROW = "narrow"  # a Narrowing link: all its rows in one forward of its own
    PIECE = "piece"  # link rows [start, stop) of its plan, packed with the step's other rows
    DECODE = "decode"  # its next token's row
    REPAIR = "repair"  # rows [start, stop) of a decoding sequence's stale cache, recomputed (Sequence.repair)
    TASK = "task"  # Sequence.task(runner), alone: work outside any request, or a change between steps


@dataclass(frozen=True)
class Work:
    """One sequence's share of a step."""

    sequence: Sequence
    kind: Kind
    start: int = 0
    stop: int = 0

    @property
    def rows(self) -> int:
        return 1 if self.kind is Kind.DECODE else self.stop - self.start

    @property
    def ends_link(self) -> bool:
        return self.kind is Kind.NARROW or (self.kind is Kind.PIECE and self.stop == self.sequence.plan.rows.numel())

    @property
    def needs_logits(self) -> bool:
        return self.kind is Kind.DECODE or (self.ends_link and self.sequence.compile is None)


@dataclass
class StepPlan:
    """A step: PLACE and NARROW works each run alone; PIECE and DECODE works run in one packed forward, in order.
    `base_weights`: the step runs the base model (a background sequence's)."""

    kind: Kind
    work: list[Work] = field(default_factory=list)
    base_weights: bool = False

    @property
    def rows(self) -> int:
        return sum(w.rows for w in self.work) if self.kind in (Kind.PIECE, Kind.DECODE) else 0

    @property
    def decode_rows(self) -> int:
        return sum(w.kind is Kind.DECODE for w in self.work)

    @property
    def repair_rows(self) -> int:
        return sum(w.rows for w in self.work if w.kind is Kind.REPAIR)

    def narrowed_rows(self) -> int:
        """A NARROW step's link rows (`rows` counts a packed forward's only); read before the step, which ends the
        link and lets go of its plan."""
        if self.kind is not Kind.NARROW:
            return 0
        return sum(w.sequence.plan.rows.numel() for w in self.work if w.sequence.plan is not None)


@dataclass(frozen=True)
class StepResult:
    """What the runner gives back for one work: its link plan (PLACE), its last row's logits and the token sampled
    from them (None where it needs none), a compile's entry or a task's return value, or the error that failed it."""

    plan: object = None
    linked: object = None
    step: object = None
    error: BaseException | None = None
    result: object = None


def narrows(sequence: Sequence) -> bool:
    """Placed, its rows waiting for a NARROW step of their own."""
    return sequence.plan is not None and sequence.plan.narrow is not None


class Scheduler:
    MAX_PASSED_OVER = 2  # a long link runs at least every third step, whatever stream of shorter ones arrives

    def __init__(
        self, row_budget: int = DEFAULT_ROW_BUDGET, batch_invariant: bool = False, link_row_budget: int | None = None
    ):
        self.batch_invariant = batch_invariant
        self.set_row_budgets(row_budget, link_row_budget)
        self.waiting: deque[Sequence] = deque()
        self.background: deque[Sequence] = deque()  # admitted one at a time, only while no user sequence runs
        self.tasks: deque[Sequence] = deque()
        self.after_task = False  # the last step ran a task: the requests' turn
        # the last step (a PLACE or a NARROW) ran none of the running sequences' rows: a forward step of theirs is
        # next, whatever arrived since, so no run of such steps keeps a decoding stream waiting
        self.owed = False
        self.placed_last = False  # of PLACE and NARROW steps, the last was a PLACE: a narrowing link's turn
        self.running: list[Sequence] = []
        self.base_turn = False  # the next forward step is for the base weights' rows, left out of the last one
        self.base_last = False  # of the steps the decoding streams are not in, the last ran the base weights' rows

    def set_row_budgets(self, row_budget: int, link_row_budget: int | None = None) -> None:
        """The step's row budgets from the next plan on (on the model thread, between steps)."""
        self.row_budget = row_budget  # while a stream decodes, or once a link has ended in the step: they wait for it
        # while nothing does: nothing waits on the step's length, and a long link runs in fewer, larger steps (on a
        # GPU a step costs its launches too). Batch-invariant, pieces are row_budget's whatever the load.
        self.link_row_budget = row_budget if link_row_budget is None or self.batch_invariant else link_row_budget

    def add(self, sequence: Sequence) -> None:
        queue = self.tasks if sequence.task is not None else self.background if sequence.background else self.waiting
        queue.append(sequence)

    def has_work(self) -> bool:
        return bool(self.tasks or self.waiting or self.running or self.background)

    def abort(self, sequence: Sequence) -> list[tuple[Sequence, Output]]:
        """Take a sequence out wherever it is; its Aborted output (none if it is over already)."""
        for holder in (self.tasks, self.waiting, self.background, self.running):
            if sequence in holder:
                holder.remove(sequence)
                return [(sequence, Output(status=Status.ABORTED))]
        return []

    # -- the plan ---------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step, or None when nothing runs. Tasks and the requests' steps take turns: callers that queue
        task after task never keep a decoding stream waiting for more than one of them."""
        task_turn, self.after_task = bool(self.tasks) and not self.after_task, False
        plan = None if task_turn else self._requests()
        if plan is None and self.tasks:
            self.after_task = True
            return StepPlan(Kind.TASK, [Work(self.tasks.popleft(), Kind.TASK)])
        return plan

    def _requests(self) -> StepPlan | None:
        """After a step the decoding streams were not in (PLACE, NARROW, the base weights' rows), the step owed to
        them. The steps apart and a base weights' turn that an owed step put off take turns: arrivals every other
        step would otherwise keep that turn from ever coming, or the base weights' rows hold arrivals back."""
        if self.owed:
            self.owed = False
            if (plan := self._forward(owed=True)) is not None:
                return plan
        if self.base_turn and not self.base_last:
            plan = self._forward() or self._apart()
        else:
            plan = self._apart() or self._forward()
        decoding = any(s.status is Status.DECODING for s in self.running)
        # owed after a base weights' step only to streams that wait for it: with none, it would be a second one
        self.owed = plan is not None and (plan.kind is not Kind.PIECE or (plan.base_weights and decoding))
        if plan is not None and (plan.kind is not Kind.PIECE or plan.base_weights):
            self.base_last = plan.base_weights
        return plan

    def _apart(self) -> StepPlan | None:
        """A step apart from the forward ones: arrivals placed, or a narrowing link's rows; the two by turns while
        both wait, so that neither arrivals coming every step nor narrowing links placed together hold the other."""
        users = any(not s.background for s in self.running)
        narrowing = next((s for s in self.running if narrows(s) and not (s.background and users)), None)
        if (narrowing is None or not self.placed_last) and (placing := self._admit()):
            self.placed_last = True
            return StepPlan(Kind.PLACE, [Work(s, Kind.PLACE) for s in placing], placing[0].background)
        if narrowing is None:
            return None
        self.placed_last = False
        return StepPlan(Kind.NARROW, [Work(narrowing, Kind.NARROW)], narrowing.background)

    def _admit(self) -> list[Sequence]:
        """The waiting user sequences in order, while the rows their placing runs through the model fit the step's
        budget (one at least); else one background sequence while no other runs."""
        if self.waiting:
            decoding = any(s.status is Status.DECODING for s in self.running)
            budget = self.row_budget if decoding else self.link_row_budget
            admitted = [self.waiting.popleft()]
            rows = admitted[0].place_rows
            # past the budget (the first alone was) only with arrivals that run no rows
            while self.waiting and rows + self.waiting[0].place_rows <= max(budget, rows):
                rows += self.waiting[0].place_rows
                admitted.append(self.waiting.popleft())
        elif self.background and not self.running:
            admitted = [self.background.popleft()]
        else:
            return []
        for sequence in admitted:
            sequence.status = Status.LINKING
        self.running.extend(admitted)
        return admitted

    def _forward(self, owed: bool = False) -> StepPlan | None:
        """`owed`: the step after a PLACE or NARROW, whose decoding streams run in it (not a base weights' turn)."""
        decoding = [s for s in self.running if s.status is Status.DECODING]
        users = any(not s.background for s in self.running)
        linking = [
            s
            for s in self.running
            if s.status is Status.LINKING and s.pending_rows and not ((s.background and users) or narrows(s))
        ]
        base = self._base_step(decoding, linking, owed)
        work = [] if base else self._decodes(decoding)
        # the decoding streams wait for this step even when their rows are not in it; their repairs are out of the
        # link pieces' budget (a large one would otherwise leave a link beside it a row a step)
        decode_rows, decoding_works = sum(w.rows for w in work if w.kind is Kind.DECODE), len(work)
        budget = max(self.row_budget - decode_rows, 1) if decoding else self.link_row_budget
        linking = [s for s in linking if s.base_weights == base]
        for sequence in sorted(linking, key=self._urgency):  # link pieces until the budget is spent
            pending = sequence.pending_rows
            if budget <= 0:
                continue
            size = self._piece_size(pending, budget, first=len(work) == decoding_works)
            if size == 0:
                continue
            work.append(Work(sequence, Kind.PIECE, sequence.linked_rows, sequence.linked_rows + size))
            budget -= size
            if size == pending:  # its link ends here and its answer waits for the step: no longer than row_budget's
                budget = min(budget, self.row_budget - sum(w.rows for w in work if w.kind is not Kind.REPAIR))
        pieces = {w.sequence for w in work if w.kind is Kind.PIECE}
        for sequence in linking:
            sequence.passed_over = 0 if sequence in pieces else sequence.passed_over + 1
        if not work:
            return None
        return StepPlan(Kind.PIECE, work, base)

    def _decodes(self, decoding: list[Sequence]) -> list[Work]:
        """The decoding sequences' rows: a decode row each, then the repair pieces (Sequence.repair), each riding
        with its own sequence's decode row. A repair is cut where the sequence alone would cut it, whatever else
        runs (batch invariance), so no budget may shorten it; repairs take the row budget by turns instead: the
        longest left out first, then in arrival order, as many as fit in it (one at least). A repairing sequence
        left out sits the step out, its decode row too, so that its next token still comes with the same rows
        repaired as alone. A step then holds repair rows past the budget only for one repair larger than it."""
        sizes = {s: s.repair.size(s.cache.length) for s in decoding if s.repair is not None}
        repairing = [s for s in decoding if sizes.get(s, 0) > 0]
        taken, rows = 0, 0
        for s in sorted(repairing, key=lambda s: -s.repair.waited):
            if taken and rows + sizes[s] > self.row_budget:
                s.repair.waited += 1
                continue
            s.repair.waited = 0
            s.repair.width = s.repair.width or sizes[s]
            rows, taken = rows + sizes[s], taken + 1
        waiting = {s for s in repairing if s.repair.waited}
        decodes = [Work(s, Kind.DECODE) for s in decoding if s not in waiting]
        repairs = [Work(s, Kind.REPAIR, s.repair.next, s.repair.next + sizes[s]) for s in repairing if s not in waiting]
        return decodes + repairs

    def _urgency(self, sequence: Sequence) -> tuple[bool, int]:
        """The order link pieces take the budget in: those passed over too long first, the longest passed over
        before the others; then the fewest pending rows (shortest remaining work first: the most first tokens per
        step). Ties keep their arrival order."""
        starved = sequence.passed_over >= self.MAX_PASSED_OVER
        return not starved, -sequence.passed_over if starved else sequence.pending_rows

    def _base_step(self, decoding: list[Sequence], linking: list[Sequence], owed: bool = False) -> bool:
        """Whether the next forward step runs the base weights' rows: when they are all there is, or by turns while
        the others wait too (a decoding stream then waits one step of them, as behind any link piece; never right
        after it waited for a PLACE or NARROW step: the turn is kept for the next)."""
        waiting = any(s.base_weights for s in linking)
        others = bool(decoding) or any(not s.base_weights for s in linking)
        base = waiting and ((self.base_turn and not (owed and decoding)) or not others)
        self.base_turn = waiting and not base
        return base

    def _piece_size(self, pending: int, budget: int, first: bool) -> int:
        """How many of a sequence's pending link rows this step runs. Batch-invariant: a whole piece of the row
        budget (or the last rows), cut where the sequence alone would cut it, since a row's attention depends on
        where its piece starts; the step's first piece is taken even past what the decode rows left of the budget,
        so a step may hold up to one row per decoding sequence more than the budget."""
        if not self.batch_invariant:
            return min(budget, pending)
        size = min(self.row_budget, pending)
        return size if first or size <= budget else 0

    # -- after the step ---------------------------------------------------------------------------------------
    def update(self, plan: StepPlan, results: Seq[StepResult]) -> list[tuple[Sequence, Output]]:
        """Apply a step's results: rows done, links ended, tokens sampled; the sequences' outputs, in order (those
        that are over have left `running`)."""
        outputs = []
        for work, result in zip(plan.work, results):
            sequence = work.sequence
            if work.kind is Kind.REPAIR:  # no output of its own: a step that fails fails its decode row too
                if result.error is None and sequence.repair is not None:
                    # caught up: the step's decode row attended to exact rows only, so it is exact too, and so is
                    # every row decoded after it: nothing is left to repair
                    caught_up = work.stop == sequence.cache.length - 1
                    sequence.repair.next = work.stop
                    sequence.stats.repaired_tokens += work.stop - work.start
                    sequence.stats.repair_caught_up |= caught_up
                    if caught_up:
                        sequence.repair = None
                continue
            if result.error is not None:
                outputs.append((sequence, self._leave(sequence, Output(status=Status.FAILED, error=result.error))))
                continue
            if work.kind is Kind.PLACE:
                sequence.plan, sequence.cache = result.plan, result.plan.cache
            elif work.kind is Kind.PIECE:
                sequence.linked_rows = work.stop
            if work.kind is Kind.TASK or (work.ends_link and sequence.compile is not None):  # its result is all
                outputs.append((sequence, self._leave(sequence, Output(status=Status.FINISHED, result=result.result))))
                continue
            if result.linked is None and not work.needs_logits:
                continue
            outputs.append((sequence, self._advance(sequence, result)))
        return [(s, o) for s, o in outputs if o is not None]

    def _advance(self, sequence: Sequence, result: StepResult) -> Output | None:
        """A sequence whose link ended or which sampled a token: decoding, or over."""
        if result.linked is not None:  # what it read from the store is in its cache now: not kept for its decode
            sequence.repair = _repair(sequence)
            sequence.plan = sequence.parts = None
        step, decoding = result.step, sequence.decoding
        cache = sequence.cache
        if decoding is None or step is None or decoding.finished or cache.length >= cache.capacity:
            return self._leave(sequence, Output(result.linked, step, Status.FINISHED))
        sequence.status = Status.DECODING
        sequence.next_token = step.token_id
        return Output(result.linked, step)

    def _leave(self, sequence: Sequence, output: Output) -> Output:
        if sequence in self.running:
            self.running.remove(sequence)
        return output

    def fail_all(self, error: BaseException) -> list[tuple[Sequence, Output]]:
        """Every sequence it holds, failed (a bug in a step; the engine stopping)."""
        held = [*self.tasks, *self.running, *self.waiting, *self.background]
        self.tasks, self.running, self.waiting, self.background = deque(), [], deque(), deque()
        return [(s, Output(status=Status.FAILED, error=error)) for s in held]


def _repair(sequence: Sequence) -> Repair | None:
    """What a sequence whose link just ended repairs while it decodes: its rows from where its cache stops being
    `full`'s, if it asked for repair (LinkParams.repair) and its link left stale rows."""
    plan, params = sequence.plan, sequence.params
    if plan is None or params is None or not params.repair or sequence.decoding is None:
        return None
    if plan.exact_until >= plan.token_ids.numel():
        return None
    return Repair(plan.token_ids, plan.exact_until, params.repair)
