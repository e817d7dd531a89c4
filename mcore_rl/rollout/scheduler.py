"""Continuous batching for the embedded engine: sequences join and leave one running batch at decode-step boundaries.

```
waiting --admit (up to max_running)--> prefill (one pass per distinct prompt; n copies share it) --> sample 1st token
running --decode step: feed every row's last token, one forward, sample per row--> append --> finished rows leave
controls (weight commit, abort, pause, release memory) run between steps, so no token mixes two weight versions
```

The running batch keeps one transformers `DynamicCache` whose rows are left-padded to a common width; a row's real
tokens sit at the right, the attention mask hides the padding, and position ids count real tokens only, so each row
computes what it would alone (up to float summation order). Newly prefilled rows are padded and concatenated into the
cache; finished rows are dropped with `index_select`, and leading columns that are padding in every row are trimmed.

Each sequence samples with its own `torch.Generator` (seeded from `sampling_seed`), so its tokens do not depend on
which other sequences shared its batch. Used in-process (`run_until_done`, what `HFRolloutEngine.generate` does) or
on a background thread behind the HTTP server (`start`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mcore_rl.rollout.sampling import Sample, sample_rows

if TYPE_CHECKING:
    from mcore_rl.rollout.engine import HFRolloutEngine

log = logging.getLogger(__name__)

#: a common prefix of an admission's distinct inputs gets its own prefill from this many tokens on: below it the
#: extra forward's fixed cost (a Python pass over every layer) outweighs the positions it saves
MIN_SHARED_PREFIX = 16


@dataclass(frozen=True)
class GenParams:
    """One sequence's sampling settings (SGLang's `sampling_params`, validated by the server)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  #: 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  #: <= 0 = off
    min_p: float = 0.0
    min_new_tokens: int = 0  #: EOS and stop tokens are masked until this many tokens exist
    stop: tuple[str, ...] = ()  #: stop strings (need a tokenizer to detokenize)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  #: None = a fresh random seed


@dataclass(eq=False)
class Sequence:
    """One sampled continuation of one prompt, as it moves waiting -> running -> finished."""

    rid: str
    prompt_ids: list[int]
    params: GenParams
    return_logprob: bool = False
    logprob_start_len: int = -1  #: >= 0: also return logprobs of prompt tokens from this position
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    #: called on the scheduler thread after tokens were appended and when the sequence finishes
    on_event: Callable[[Sequence], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish: dict[str, Any] | None = None  #: SGLang's finish_reason: {"type": "stop" | "length" | "abort", ...}
    cached_tokens: int = 0  #: prompt tokens whose prefill another sequence of the same request computed
    weight_versions: list[list[Any]] = field(default_factory=list)  #: [version, start, end) spans of output tokens
    routed: torch.Tensor | None = None  #: int32 [positions fed, layers, top_k]
    created: float = field(default_factory=time.monotonic)
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self.generator.manual_seed(seed)

    @property
    def weight_version(self) -> Any:
        """The version the last token was sampled with (None before the first token)."""
        return self.weight_versions[-1][0] if self.weight_versions else None

    def routed_experts(self) -> torch.Tensor | None:
        """SGLang's `routed_experts`: positions `[routed_experts_start_len, len(prompt + output) - 1)`."""
        if not self.return_routed_experts or self.routed is None:
            return None
        end = len(self.prompt_ids) + len(self.output_ids) - 1
        return self.routed[self.routed_experts_start_len : end]

    def to_sample(self) -> Sample:
        """The finished sequence as the RL loop's `Sample`."""
        finish = (self.finish or {}).get("type", "abort")
        return Sample(
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.output_ids),
            response_logprobs=list(self.output_logprobs),
            finish_reason=finish,
            weight_version=self.weight_version,
            weight_versions=[tuple(span) for span in self.weight_versions],
            routed_experts=self.routed_experts(),
        )


class ContinuousBatcher:
    """The running batch of one engine and its waiting queue; see the module docstring."""

    def __init__(
        self,
        engine: HFRolloutEngine,
        *,
        max_running: int = 256,
        context_length: int | None = None,
        eos_token_ids: Iterable[int] = (),
        stop_checker: Callable[[Sequence], str | None] | None = None,
    ) -> None:
        """`stop_checker(seq)` returns the stop string the output now ends with, or None (needs a tokenizer)."""
        self.engine = engine
        self.max_running = max_running
        self.context_length = context_length or engine.context_length
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_checker = stop_checker
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._controls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._rows: list[Sequence] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [B, W] 1 = real token
        self._pos: torch.Tensor | None = None  # [B] next position id (= real tokens fed)
        self._pending: torch.Tensor | None = None  # [B] last sampled token, not yet fed
        self._paused = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        #: sequences taken off the waiting queue by the admission under way (not yet rows): a failing prefill must
        #: finish them too, or their requests wait forever
        self._admitting: list[Sequence] = []
        #: forward passes completed (prefills and decode steps); /health reads it as SGLang's reads the time of the
        #: scheduler's last output
        self.progress = 0
        self.stats = {
            "prefill_tokens": 0,
            "cached_tokens": 0,
            "num_prefills": 0,
            "decode_steps": 0,
            "generated_tokens": 0,
        }

    # ------------------------------------------------------------------ public API (any thread)
    @property
    def num_running(self) -> int:
        return len(self._rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def paused(self) -> bool:
        return self._paused

    def submit(self, seqs: Iterable[Sequence]) -> None:
        """Queue sequences; they join the running batch at the next step with room."""
        with self._cond:
            self._waiting.extend(seqs)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the scheduler thread between two steps; the future holds its result or exception."""
        future: Future = Future()
        with self._cond:
            self._controls.append((fn, future))
            self._cond.notify_all()
        if self._thread is None:  # in-process use: nothing else would run it
            self._run_controls()
        return future

    def abort(self, rid: str | None = None, message: str = "aborted") -> Future:
        """Finish the waiting and running sequences whose rid is `rid` (or that start with `rid_`), or all of them."""

        def _abort() -> int:
            def hit(s: Sequence) -> bool:
                return rid is None or s.rid == rid or s.rid.startswith(rid + "_")

            with self._cond:  # take them out of the queue atomically: a request submitted meanwhile stays queued
                queued = [s for s in self._waiting if hit(s)]
                self._waiting = deque(s for s in self._waiting if not hit(s))
            running = [s for s in self._rows if hit(s)]
            for seq in running:
                seq.finish = {"type": "abort", "message": message}
            self._drop_finished()  # before anyone is told (see _sample_and_append)
            for seq in queued + running:
                seq.finish = None
                self._finish(seq, {"type": "abort", "message": message})
            return len(queued) + len(running)

        return self.call(_abort)

    def pause(self, mode: str) -> Future:
        """Stop stepping. abort: finish everything in flight; retract: running rows go back to the waiting queue
        (their tokens kept, KV dropped, re-prefilled on continue); in_place: rows keep their KV and wait."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")

        def _pause() -> None:
            if mode == "abort":
                with self._cond:  # atomically: what is submitted after this point waits for continue_generation
                    victims, self._waiting = [*self._waiting, *self._rows], deque()
                self._rows, self._cache, self._mask, self._pos, self._pending = [], None, None, None, None
                for seq in victims:
                    self._finish(seq, {"type": "abort", "message": "generation paused (mode=abort)"})
            elif mode == "retract":
                self._waiting.extendleft(reversed(self._rows))
                self._rows, self._cache, self._mask, self._pos, self._pending = [], None, None, None, None
            self._paused = True

        return self.call(_pause)

    def resume(self) -> Future:
        """Continue stepping after `pause`."""

        def _resume() -> None:
            self._paused = False

        return self.call(_resume)

    def start(self) -> None:
        """Step on a background thread until `stop`."""
        self._thread = threading.Thread(target=self._loop, name="mcore-rl-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def run_until_done(self, seqs: list[Sequence]) -> list[Sequence]:
        """In-process use (no thread): submit `seqs` and step until every one has finished."""
        self.submit(seqs)
        while any(s.finish is None for s in seqs):
            self.step()
        return seqs

    # ------------------------------------------------------------------ the scheduler thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not self._controls and (self._paused or not (self._waiting or self._rows)):
                    self._cond.wait()
                if self._stopped:
                    break
            try:
                self.step()
            except Exception as err:  # keep serving: fail what was in flight (being admitted too), reset the batch
                log.exception("batcher step failed")
                with self._cond:
                    victims, self._waiting = [*self._admitting, *self._waiting, *self._rows], deque()
                self._admitting = []
                self._rows, self._cache, self._mask, self._pos, self._pending = [], None, None, None, None
                # SGLang's FINISH_ABORT with a status code: the HTTP layer answers the request with that status
                finish = {
                    "type": "abort",
                    "message": f"engine error: {type(err).__name__}: {err}",
                    "status_code": 500,
                    "err_type": "InternalServerError",
                }
                for seq in victims:
                    if seq.finish is None:
                        self._finish(seq, dict(finish))
                    elif seq.on_event is not None:  # finished by the failed step, maybe before it told anyone
                        seq.on_event(seq)

    def step(self) -> None:
        """One scheduling step: pending controls, then (unless paused) admit waiting sequences and decode once."""
        self._run_controls()
        if self._paused:
            return
        self._admit()
        self._admitting = []  # now rows or finished (a failure leaves them for _loop to finish)
        if self._rows:
            self._decode()

    def _run_controls(self) -> None:
        while True:
            with self._cond:
                if not self._controls:
                    return
                fn, future = self._controls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:  # noqa: BLE001 (handed to the caller through the future)
                    future.set_exception(err)

    @torch.inference_mode()
    def _admit(self) -> None:
        with self._cond:
            room = self.max_running - len(self._rows)
            new: list[Sequence] = []
            while room > len(new) and self._waiting:
                seq = self._waiting.popleft()
                if seq.finish is None:
                    new.append(seq)
            self._admitting = new
        if not new:
            return
        # One prefill per distinct input: the n samples of a prompt (and identical prompts) share it.
        inputs: dict[tuple[int, ...], int] = {}
        owner = [inputs.setdefault(tuple(s.prompt_ids + s.output_ids), len(inputs)) for s in new]
        unique = [list(key) for key in inputs]
        full = any(s.return_logprob and s.logprob_start_len >= 0 and not s.output_ids for s in new)
        want_routing = any(s.return_routed_experts for s in new)
        # Prompt logprobs and routed experts are read per prompt position, so those admissions compute every position.
        shared = 0 if full or want_routing else self._shared_prefix(unique)
        with self.engine.capture_routed_experts(want_routing) as routed:
            out, mask = self._prefill(unique, shared, logits_to_keep=0 if full else 1)
        width = mask.shape[1]
        index = torch.tensor(owner, device=mask.device)
        seen: set[int] = set()
        for seq, row in zip(new, owner):
            length = len(unique[row])
            if row in seen:
                seq.cached_tokens = length
            elif row > 0:  # the first distinct input computed the shared prefix for the others
                seq.cached_tokens = shared
            seen.add(row)
            if routed is not None and seq.return_routed_experts:
                seq.routed = routed[row, width - length :].clone()
            if full and seq.return_logprob and seq.logprob_start_len >= 0 and not seq.output_ids:
                seq.input_logprobs = self._input_logprobs(seq, out.logits[row, width - length :])
        self.progress += 1
        self.stats["prefill_tokens"] += shared + sum(len(t) - shared for t in unique)
        self.stats["num_prefills"] += 1  # prefill forwards: one per admission of waiting sequences
        self.stats["cached_tokens"] += sum(s.cached_tokens for s in new)
        # max_new_tokens=0: a prefill-only request (prompt logprobs for scoring); it finishes here, unsampled.
        for seq in new:
            if seq.params.max_new_tokens == 0:
                self._finish(seq, {"type": "length", "length": 0})
        keep = [i for i, s in enumerate(new) if s.finish is None]
        if not keep:
            return
        if len(keep) < len(new):
            new, index = [new[i] for i in keep], index[torch.tensor(keep, device=index.device)]
        cache = out.past_key_values
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        lengths = torch.tensor([len(s.prompt_ids) + len(s.output_ids) for s in new], device=mask.device)
        self._merge(new, cache, mask.index_select(0, index), lengths)
        first = len(self._rows) - len(new)
        self._sample_and_append(out.logits[:, -1].index_select(0, index), first)

    def _shared_prefix(self, unique: list[list[int]]) -> int:
        """Leading tokens all distinct inputs of an admission have in common, worth a prefill of their own (0 if not):
        the recipes' prompts open with the same chat-template system prompt (SmolLM2's: 31 of 44 tokens), which
        the batch would otherwise compute once per prompt. Each input keeps at least one token of its own, so its
        next-token logits come from the second forward."""
        if len(unique) < 2 or self.engine.latency_model_s_per_token is not None:  # the model prices forwards alone
            return 0
        shared = min(len(ids) for ids in unique) - 1
        for column, first in enumerate(unique[0][:shared]):
            if any(ids[column] != first for ids in unique[1:]):
                shared = column
                break
        return shared if shared >= MIN_SHARED_PREFIX else 0

    def _prefill(self, unique: list[list[int]], shared: int, logits_to_keep: int) -> tuple[Any, torch.Tensor]:
        """Prefill the distinct inputs `unique` as rows left-padded to a common width: (model output, mask [U, W]).

        With `shared` > 0 their common first `shared` tokens are computed once, as a batch of one row, and the rest
        of every row on top of copies of that KV: the same attention as one forward over the whole rows (up to float
        summation order), with the padding of shorter rows between the prefix and their tail, where the mask hides it.
        """
        device = self.engine.device
        cache = None
        if shared:
            prefix = torch.tensor([unique[0][:shared]], device=device)
            cache = self.engine.forward(
                input_ids=prefix,
                attention_mask=torch.ones_like(prefix),
                position_ids=torch.arange(shared, device=device).unsqueeze(0),
                use_cache=True,
                logits_to_keep=1,
            ).past_key_values
            every_row = torch.zeros(len(unique), dtype=torch.long, device=device)
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, every_row)
                layer.values = layer.values.index_select(0, every_row)
            self.progress += 1
        tails = [tokens[shared:] for tokens in unique]
        width = max(len(tokens) for tokens in tails)
        ids = torch.zeros(len(unique), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(tails):
            ids[row, width - len(tokens) :] = torch.tensor(tokens, device=device)
            mask[row, width - len(tokens) :] = 1
        positions = shared + (mask.cumsum(-1) - 1).clamp_(min=0)
        mask = torch.cat([mask.new_ones(len(unique), shared), mask], dim=1)
        out = self.engine.forward(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        return out, mask

    @torch.inference_mode()
    def _decode(self) -> None:
        assert self._mask is not None and self._pos is not None and self._pending is not None
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(self._rows), 1)], dim=1)
        want_routing = any(s.return_routed_experts for s in self._rows)
        with self.engine.capture_routed_experts(want_routing) as routed:
            out = self.engine.forward(
                input_ids=self._pending.unsqueeze(1),
                attention_mask=self._mask,
                position_ids=self._pos.unsqueeze(1),
                past_key_values=self._cache,
                use_cache=True,
            )
        self._cache = out.past_key_values
        self._pos = self._pos + 1
        if routed is not None:
            for row, seq in enumerate(self._rows):
                if seq.return_routed_experts and seq.routed is not None:
                    seq.routed = torch.cat([seq.routed, routed[row]])
        self.progress += 1
        self.stats["decode_steps"] += 1
        self._sample_and_append(out.logits[:, -1], 0)

    # ------------------------------------------------------------------ batch bookkeeping
    def _merge(self, new: list[Sequence], cache: Any, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        """Append prefilled rows to the running batch, left-padding the narrower side to a common width."""
        pending = torch.zeros(len(new), dtype=torch.long, device=mask.device)
        if self._cache is None or not self._rows:
            self._rows, self._cache, self._mask, self._pos, self._pending = list(new), cache, mask, lengths, pending
            return
        width = max(self._mask.shape[1], mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for old_layer, new_layer in zip(self._cache.layers, cache.layers):
            old_layer.keys = torch.cat([pad(old_layer.keys, 2), pad(new_layer.keys, 2)])
            old_layer.values = torch.cat([pad(old_layer.values, 2), pad(new_layer.values, 2)])
        self._mask = torch.cat([pad(self._mask, 1), pad(mask, 1)])
        self._pos = torch.cat([self._pos, lengths])
        self._pending = torch.cat([self._pending, pending])
        self._rows.extend(new)

    def _sample_and_append(self, logits: torch.Tensor, first: int) -> None:
        """Sample the next token of rows `first..` from their logits, append it, finish and drop what is done."""
        rows = self._rows[first:]
        logits = logits.float()
        for i, seq in enumerate(rows):  # EOS and stop tokens are not allowed before min_new_tokens
            if len(seq.output_ids) < seq.params.min_new_tokens:
                banned = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[i, sorted(t for t in banned if t < logits.shape[-1])] = float("-inf")
        p = [s.params for s in rows]
        tokens, logprobs = sample_rows(
            logits,
            torch.tensor([x.temperature for x in p]),
            torch.tensor([x.top_p for x in p]),
            torch.tensor([x.top_k for x in p]),
            torch.tensor([x.min_p for x in p]),
            [s.generator for s in rows],
        )
        assert self._pending is not None
        self._pending[first:] = tokens.to(self._pending.device)
        version = self.engine.weight_version
        for seq, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
            seq.output_ids.append(token)
            seq.output_logprobs.append(logprob)
            n = len(seq.output_ids)
            if seq.weight_versions and seq.weight_versions[-1][0] == version:
                seq.weight_versions[-1][2] = n
            else:
                seq.weight_versions.append([version, n - 1, n])
            self.stats["generated_tokens"] += 1
            seq.finish = self._finish_reason(seq, token)
        # Drop finished rows before telling anyone, so a caller that sees a finished sequence also sees it gone.
        self._drop_finished()
        for seq in rows:
            if seq.on_event is not None:
                seq.on_event(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> dict[str, Any] | None:
        params, n = seq.params, len(seq.output_ids)
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if params.stop and self.stop_checker is not None:
            matched = self.stop_checker(seq)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        if n >= params.max_new_tokens or len(seq.prompt_ids) + n >= self.context_length:
            return {"type": "length", "length": n}
        return None

    def _finish(self, seq: Sequence, finish: dict[str, Any]) -> None:
        if seq.finish is not None:
            return
        seq.finish = finish
        if seq.on_event is not None:
            seq.on_event(seq)

    def _drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self._rows) if s.finish is None]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._cache, self._mask, self._pos, self._pending = [], None, None, None, None
            return
        assert self._mask is not None and self._pos is not None and self._pending is not None
        index = torch.tensor(keep, device=self._mask.device)
        mask = self._mask.index_select(0, index)
        start = int(mask.any(0).nonzero()[0])  # columns that are padding in every remaining row
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]
        self._mask = mask[:, start:]
        self._pos = self._pos.index_select(0, index)
        self._pending = self._pending.index_select(0, index)
        self._rows = [self._rows[i] for i in keep]

    @staticmethod
    def _input_logprobs(seq: Sequence, logits: torch.Tensor) -> list[float | None]:
        """Logprobs of prompt tokens `[logprob_start_len, P)`; position 0 has none (nothing predicts it)."""
        temperature = seq.params.temperature if seq.params.temperature > 0 else 1.0
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        targets = torch.tensor(seq.prompt_ids[1:], device=logits.device)
        values = logp[:-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist() if len(seq.prompt_ids) > 1 else []
        return [None, *values][seq.logprob_start_len :]
