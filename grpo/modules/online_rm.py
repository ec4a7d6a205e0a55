"""A reward model updated online on the policy's own samples, a trained module (grpo.modules).

    rewards:
      - {name: accuracy, weight: 0.0}      # optional: the true accuracy, logged only
    modules:
      - name: online_reward_model          # this factory
        kwargs:
          init: runs/rm/final              # a `grpo rm` checkpoint (a sequence classifier)
          labeller: verifier               # a registered name or package.module:function
          labeller_kwargs: {reward: accuracy, reward_kwargs: {strict: true}}
          label_budget: 32                 # labeller calls per step (the global batch)
        optim: {lr: 3.0e-4, schedule: constant}

Each step the module's score of every completion is its reward (`TrainedModule.rewards`,
``rewards/online_rm``), added to the configured rewards' weighted sum before the advantages,
scored as the `reward_model` reward scores (`grpo.rewards.model.score_completions`: the reward
model's own tokenizer and chat template over [system?, user: question, assistant: completion]).
After the policy's update, `loss` collects preference labels on the step's rollouts: it draws
pairs of two different completions of one prompt (one GRPO group), asks the labeller at most
`label_budget` times, and takes `updates` Bradley-Terry steps (`grpo.algo.preference.pair_loss`,
the loss `grpo rm` trains with) on the labelled pairs, each with `replay` pairs labelled at
earlier steps drawn afresh from a buffer of the last `replay_size`, and `rehearsal` pairs of a
fixed preference dataset (`rehearsal_data`: typically the pairs the reward model was trained on,
so that it keeps what it knew while it learns the policy's new errors). The rewards of a step
come from the reward model before it learns from that step's labels; with `label_first: true`
the labels and updates come first, after the rollout (`TrainedModule.trains_first`), and the
step's rewards come from the reward model that has just learned from labels of those very
completions (the labels still go to the reward model only).

Which pairs (`pairs`): ``random`` draws uniformly among the batch's pairs whose texts differ;
``ranked`` orders each group by the step's scores and pairs its best with its worst, its second
with its second-worst and so on (each completion in at most one pair), all groups' first pairs
asked before any second pair. The completions the policy is pushed towards are the ones
labelled: where the reward model is being gamed, its best-scored completion is wrong and its
worst is often right, the label that corrects it.

A labeller is ``labeller(row, completion_a, completion_b, **labeller_kwargs) -> number``:
> 0 prefers a, < 0 prefers b, 0 (a tie) gives no pair (the call still counts against the
budget). `verifier` (here) asks a reward function, by default the strict `accuracy` rule,
standing in for a person; ``{reward: judge, reward_kwargs: {...}}`` asks an LLM judge
(`grpo.rewards.judge`); a plug-in is any ``package.module:function`` or a name given to
`register_labeller`.

State: the model's weights, the counters ``steps`` (training steps labelled) and ``labels``
(labeller calls so far) as int64 tensors, and the replay buffer (its pairs' token ids,
``replay/tokens`` and ``replay/lengths``) in the module's checkpoint state; the draws of a step
come from generators seeded with (seed, rank, steps[, update]), so a resumed run draws the same
pairs as an uninterrupted one. Under torchrun every rank labels its own rows, the budget split
over the ranks (the first budget % world ranks one more), every rank keeps the same buffer (the
labelled pairs of every rank, in rank order) and takes its share of one draw of `replay` pairs
from it, and the loss is the mean over the pairs of the global batch. Every weight trains (full
fine-tuning: no LoRA).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from grpo.algo.preference import collate_pairs, pair_loss
from grpo.algo.registry import Registry
from grpo.distributed import all_reduce_sum, gather_objects
from grpo.errors import GrpoError
from grpo.models.classifier import sequence_scores
from grpo.modules.base import TrainedModule, register_trained_module

if TYPE_CHECKING:
    from grpo.policy import Policy

LABELLERS = Registry("labeller", "modules[online_reward_model].kwargs.labeller")
REWARD_KEY = "online_rm"  # its reward's name: rewards/online_rm
PAIRINGS = ("random", "ranked")  # how a step's pairs are drawn (module docstring)


def register_labeller(name: str, *, overwrite: bool = False):
    """Decorator: a labeller ``fn(row, completion_a, completion_b, **kwargs) -> number``,
    selectable as ``labeller: <name>``."""
    return LABELLERS.register(name, overwrite=overwrite)


_VERIFIERS: dict[str, Any] = {}  # (reward, kwargs) -> the reward function, built once


@register_labeller("verifier")
def verifier(
    row: dict,
    completion_a: str,
    completion_b: str,
    reward: str = "accuracy",
    reward_kwargs: dict | None = None,
) -> float:
    """Prefers the completion a reward function scores higher (0: equal scores).

    Args:
        row: the prompt's dataset row (its columns go to the reward, as in training).
        completion_a, completion_b: two completions of that prompt.
        reward: a reward name or ``package.module:function`` (`grpo.rewards.get_reward`);
            default the strict `accuracy` rule (a verifier standing in for a person).
        reward_kwargs: its parameters (default for `accuracy`: ``{strict: true}``).
    """
    from grpo.rewards import get_reward
    from grpo.rewards.functions import RewardContext, wants_context

    if reward_kwargs is None:
        reward_kwargs = {"strict": True} if reward == "accuracy" else {}
    key = repr((reward, sorted(reward_kwargs.items())))
    if key not in _VERIFIERS:
        _VERIFIERS[key] = get_reward({"name": reward, **reward_kwargs})
    fn = _VERIFIERS[key]
    columns = {k: [v, v] for k, v in row.items()}
    if wants_context(fn):
        columns["context"] = RewardContext()
    out = fn([completion_a, completion_b], **columns)
    values = out[0] if isinstance(out, tuple) else out  # (values, metrics) from some rewards
    a, b = float(values[0]), float(values[1])
    return (a > b) - (a < b)


class OnlineRewardModel(TrainedModule):
    """A reward model trained beside the policy on labels of its samples (module docstring).

    Args:
        model: a classifier `Decoder` (one output), every weight trainable.
        tokenizer: the reward model's tokenizer.
        labeller: ``fn(row, completion_a, completion_b) -> number`` (kwargs bound).
        label_budget: labeller calls per step over the global batch.
        dist: the trainer ranks.
        precision: the run's precision policy (scoring and the update run under it).
        seed: the pair draws' seed.
        batch_size: rows per scoring forward. max_length: tokens per row (a longer prompt
            keeps its end). system_prompt: the system message of the reward model's pairs.
        center_coef: the reward-centering term's weight in the pair loss.
        pairs: ``random`` or ``ranked`` (module docstring).
        updates: optimizer steps per training step (`TrainedModule.updates`).
        replay: earlier labelled pairs (global) added to each update. replay_size: the
            buffer's capacity in pairs (the oldest dropped first).
        rehearsal: pairs of `rehearsal_pairs` (global) added to each update.
        rehearsal_pairs: encoded `PreferencePair`s of a fixed preference dataset.
        label_first: label and update before the step's rewards (module docstring).
    """

    def __init__(
        self,
        model,
        tokenizer,
        labeller,
        label_budget: int,
        dist,
        precision,
        seed: int,
        batch_size: int = 64,
        max_length: int = 1024,
        system_prompt: str | None = None,
        center_coef: float = 0.0,
        pairs: str = "random",
        updates: int = 1,
        replay: int = 0,
        replay_size: int = 10000,
        rehearsal: int = 0,
        rehearsal_pairs: list | None = None,
        label_first: bool = False,
    ):
        super().__init__()
        self.trains_first = label_first
        self.model, self.tokenizer, self.labeller = model, tokenizer, labeller
        self.label_budget, self.dist, self.precision, self.seed = (
            label_budget,
            dist,
            precision,
            seed,
        )
        self.batch_size, self.max_length = batch_size, max_length
        self.system_prompt, self.center_coef = system_prompt, center_coef
        self.pairing, self.updates, self.replay = pairs, updates, replay
        self.buffer: deque = deque(maxlen=replay_size)  # PreferencePairs, oldest first
        self.rehearsal, self.rehearsal_pairs = rehearsal, list(rehearsal_pairs or [])
        self._step: _Step | None = None  # the step being trained on
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # updates taken
        self.register_buffer("labels", torch.zeros((), dtype=torch.long))  # labeller calls
        pad = model.config.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.pad_token_id or 0)

    @property
    def device(self) -> torch.device:
        return self.model.score.weight.device

    # -- scoring: the step's reward ------------------------------------------------------

    def scores(self, rows: list[dict], texts: list[str]) -> torch.Tensor:
        """(B,) float32 scores on the CPU of `texts`, each with its row's question."""
        from grpo.rewards.model import score_completions

        questions = [_question(r) for r in rows]
        return score_completions(
            self.model,
            self.tokenizer,
            questions,
            texts,
            self.batch_size,
            self.max_length,
            self.system_prompt,
            self.precision,
        )

    def rewards(self, batch) -> dict[str, torch.Tensor]:
        return {REWARD_KEY: self.scores(batch.rows, batch.texts).to(batch.rewards.device)}

    # -- labels and the update -------------------------------------------------------------

    def budget(self) -> int:
        """This rank's labeller calls per step: the budget split over the ranks."""
        world, rank = self.dist.world_size, self.dist.rank
        return self.label_budget // world + int(rank < self.label_budget % world)

    def draw_pairs(self, batch) -> list[tuple[int, int]]:
        """This step's pairs (row a, row b), both of one group and with different texts:
        `budget()` of them (fewer when the batch has fewer), drawn as `pairs` says (module
        docstring) with a generator seeded with (seed, rank, steps)."""
        G = batch.rollout.group_size
        texts = batch.texts
        gen = torch.Generator().manual_seed(_seed(self.seed, self.dist.rank, int(self.steps)))
        if self.pairing == "ranked":
            return self._ranked_pairs(batch, gen)
        candidates = [
            (g + i, g + j)
            for g in range(0, batch.size - G + 1, G)
            for i in range(G)
            for j in range(i + 1, G)
            if texts[g + i] != texts[g + j]
        ]
        order = torch.randperm(len(candidates), generator=gen)[: self.budget()].tolist()
        return [candidates[k] for k in order]

    def _ranked_pairs(self, batch, gen: torch.Generator) -> list[tuple[int, int]]:
        """(best, worst), (second, second-worst), ... of each group by the step's scores
        (ties by row), level by level, the groups of a level in a random order."""
        G, texts = batch.rollout.group_size, batch.texts
        scores = batch.per_fn.get(REWARD_KEY)
        if scores is None:  # not attached (a batch built by hand): score it now
            with torch.no_grad():
                scores = self.scores(batch.rows, texts)
        scores = scores.detach().float().cpu()
        groups = range(0, batch.size - G + 1, G)
        ranked = {g: sorted(range(g, g + G), key=lambda b: (-float(scores[b]), b)) for g in groups}
        out, budget = [], self.budget()
        for level in range(G // 2):
            for k in torch.randperm(len(ranked), generator=gen).tolist():
                order = ranked[groups[k]]
                a, b = order[level], order[G - 1 - level]
                if texts[a] != texts[b] and len(out) < budget:
                    out.append((a, b))
        return out

    def label(self, batch, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(chosen row, rejected row) of each pair the labeller did not call a tie."""
        out = []
        for a, b in pairs:
            pref = self.labeller(batch.rows[a], batch.texts[a], batch.texts[b])
            if not isinstance(pref, (int, float)) or not math.isfinite(pref):
                raise GrpoError(f"labeller returned {pref!r}; expected a finite number")
            if pref:
                out.append((a, b) if pref > 0 else (b, a))
        return out

    def encode(self, batch, chosen_rejected: list[tuple[int, int]]) -> list:
        """`grpo.data.preferences.PreferencePair`s of the labelled rows, encoded as scored."""
        from grpo.data.preferences import PreferencePair
        from grpo.rewards.model import encode_rows

        pairs = []
        for c, r in chosen_rejected:
            q = _question(batch.rows[c])
            (p_c, ids_c), (p_r, ids_r) = encode_rows(
                self.tokenizer,
                [q, q],
                [batch.texts[c], batch.texts[r]],
                self.max_length,
                self.system_prompt,
            )
            prompt = min(p_c, p_r, key=len)  # both end the same prompt: the cut that fits both
            pairs.append(PreferencePair(prompt_ids=prompt, chosen_ids=ids_c, rejected_ids=ids_r))
        return pairs

    def loss(self, batch, update):
        """This rank's share of the mean Bradley-Terry loss over the global batch's pairs: the
        step's labelled pairs (labelled at the step's first update), `replay` earlier ones and
        `rehearsal` pairs of the fixed data, both drawn afresh for each update (module
        docstring)."""
        dist = self.dist
        here = self._step
        if here is None or here.updates >= self.updates:  # the step's first update
            self._step = _Step(*self._label_step(batch))
        here = self._step
        update_index, here.updates = here.updates, here.updates + 1
        labelled = here.labelled
        replayed = self._draw(here.pool, self.replay, f"replay{update_index}")
        rehearsed = self._draw(self.rehearsal_pairs, self.rehearsal, f"rehearsal{update_index}")
        pairs = labelled + replayed + rehearsed
        n = all_reduce_sum(float(len(pairs)), dist)  # pairs of the global batch
        out = dict(here.metrics)
        out["replayed"] = all_reduce_sum(float(len(replayed)), dist)
        if self.rehearsal:
            out["rehearsed"] = all_reduce_sum(float(len(rehearsed)), dist)
        # every rank makes the same collective calls, with or without pairs of its own
        correct = 0.0
        if pairs:
            batched = collate_pairs(pairs, self.pad_id, self.device)
            with self.precision.autocast(self.device):
                scores = sequence_scores(
                    self.model, batched["ids"], batched["attention_mask"], self.pad_id
                )[:, 0]  # (2N,): the chosen sides, then the rejected
            k = len(pairs)
            chosen, rejected = scores[:k], scores[k:]
            losses = pair_loss(chosen, rejected, batched["margin"], self.center_coef)  # (N,)
            # this rank's share of the global mean; ModuleSet averages gradients over ranks
            loss = losses.sum() / n * dist.world_size
            fresh = len(labelled)
            correct = float((chosen[:fresh] > rejected[:fresh]).sum())
        else:  # no pair on this rank: a zero gradient
            loss = sum(p.sum() for p in self.model.parameters() if p.requires_grad) * 0.0
        if update_index == 0:  # the step's new pairs before any update from them
            correct = all_reduce_sum(correct, dist)
            if out["pairs"]:  # reported by every update of the step (ModuleSet's mean)
                here.metrics["pair_accuracy"] = out["pair_accuracy"] = correct / out["pairs"]
        return loss, out

    def _label_step(self, batch) -> tuple[list, list, dict]:
        """Draw and label the step's pairs; put every rank's in the buffer. Returns this
        rank's encoded pairs, the buffer as it was before them, and the step's metrics."""
        dist = self.dist
        drawn = self.draw_pairs(batch)
        labelled = self.encode(batch, self.label(batch, drawn))
        self.steps += 1
        self.labels += len(drawn)
        pool = list(self.buffer)  # what the step's updates replay: labelled at earlier steps
        if self.replay:  # every rank keeps every rank's pairs, in rank order
            for part in gather_objects(labelled, dist):
                self.buffer.extend(part)
        reported = {
            "labels": all_reduce_sum(float(len(drawn)), dist),
            "pairs": all_reduce_sum(float(len(labelled)), dist),
            "labels_total": all_reduce_sum(float(self.labels), dist),
        }
        return labelled, pool, reported

    def _draw(self, pool: list, n: int, what: str) -> list:
        """This rank's share of `n` pairs of `pool` (every rank's alike): one draw for the
        global batch, uniformly without replacement, from a generator seeded with (seed,
        steps, what) and alike on every rank; rank r takes the draw's r-th, (r+world)-th, ..."""
        if not n or not pool:
            return []
        # steps: this step's, already counted; rank -1: the draw of every rank
        gen = torch.Generator().manual_seed(_seed(self.seed, -1, int(self.steps), what))
        picks = torch.randperm(len(pool), generator=gen)[:n].tolist()
        return [pool[i] for i in picks[self.dist.rank :: self.dist.world_size]]

    # -- checkpoints: the counters, the weights and the buffer --------------------------------

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        state = dict(self.state_dict())
        if self.replay:
            state.update(_pack(list(self.buffer)))
        return state

    def load_checkpoint_state(self, weights: dict[str, torch.Tensor]) -> None:
        weights = dict(weights)
        tokens, lengths = weights.pop("replay/tokens", None), weights.pop("replay/lengths", None)
        self.load_state_dict(weights)
        self.buffer.clear()
        self._step = None
        if self.replay and tokens is not None:
            self.buffer.extend(_unpack(tokens, lengths))


@dataclasses.dataclass
class _Step:
    """A training step's labels, kept over its updates."""

    labelled: list  # this rank's encoded labelled pairs
    pool: list  # the buffer before them: what the updates replay
    metrics: dict[str, float]
    updates: int = 0  # updates taken on it (`updates` taken: the next call is a new step)


def _pack(pairs: list) -> dict[str, torch.Tensor]:
    """The buffer's pairs as two int64 tensors: every token id in order, and (N, 3) lengths
    of (prompt, chosen, rejected)."""
    flat = [t for p in pairs for t in (*p.prompt_ids, *p.chosen_ids, *p.rejected_ids)]
    lengths = [(len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)) for p in pairs]
    return {
        "replay/tokens": torch.tensor(flat, dtype=torch.long),
        "replay/lengths": torch.tensor(lengths, dtype=torch.long).reshape(-1, 3),
    }


def _unpack(tokens: torch.Tensor, lengths: torch.Tensor) -> list:
    from grpo.data.preferences import PreferencePair

    flat, out, at = tokens.tolist(), [], 0
    for p, c, r in lengths.tolist():
        ids = flat[at : at + p + c + r]
        out.append(PreferencePair(ids[:p], ids[p : p + c], ids[p + c :]))
        at += p + c + r
    return out


def _question(row: dict) -> str:
    if "question" not in row:
        raise GrpoError(
            "online_reward_model: the rows have no 'question' column (the prompt the reward "
            "model reads with each completion)"
        )
    return str(row["question"])


def _seed(seed: int, rank: int, step: int, what: str = "") -> int:
    """A 63-bit seed of (seed, rank, step, what): draws of different steps, ranks and kinds
    independent."""
    tail = f"|{what}" if what else ""
    digest = hashlib.sha256(f"online_rm|{seed}|{rank}|{step}{tail}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@register_trained_module("online_reward_model")
def online_reward_model(
    config,
    dist,
    policy: Policy,
    *,
    init: str,
    labeller: str = "verifier",
    labeller_kwargs: dict | None = None,
    label_budget: int = 32,
    batch_size: int = 64,
    max_length: int = 1024,
    system_prompt: str | None = None,
    center_coef: float = 0.0,
    seed: int | None = None,
    pairs: str = "random",
    updates: int = 1,
    replay: int = 0,
    replay_size: int = 10000,
    rehearsal: int = 0,
    rehearsal_data: str | None = None,
    rehearsal_split: str = "train",
    label_first: bool = False,
) -> OnlineRewardModel:
    """The online reward model (module docstring).

    Args:
        init: the classifier checkpoint it starts from (a `grpo rm` out/final).
        labeller: a registered labeller (`verifier`) or ``package.module:function``.
        labeller_kwargs: keyword arguments bound to every labeller call.
        label_budget: labeller calls per training step (the global batch), >= 1.
        batch_size, max_length, system_prompt: scoring, as the `reward_model` reward's.
        center_coef: the pair loss's reward-centering weight (`grpo rm`'s rm.center_coef).
        seed: the pair draws' seed (default train.seed).
        pairs: ``random`` (uniform) or ``ranked`` (each group's best-scored against its
            worst, ...; module docstring).
        updates: Bradley-Terry optimizer steps per training step, >= 1.
        replay: earlier labelled pairs added to each update (0: none, no buffer kept).
        replay_size: the buffer's capacity in pairs, >= 1.
        rehearsal: pairs of `rehearsal_data` added to each update (0: none).
        rehearsal_data: a preference dataset, as `grpo rm`'s data.dataset takes it (a
            registered name, a local file or directory, a hub id), encoded with the reward
            model's tokenizer and `max_length`; rehearsal_split: its split.
        label_first: label this step's pairs and update before its rewards are scored
            (default False: after the policy's update, the rewards one step behind).
    """
    from grpo.models import load_model
    from grpo.tokenizer import load_tokenizer

    where = "modules[online_reward_model].kwargs"
    if not isinstance(init, str) or not init:
        raise GrpoError(f"{where}.init: a classifier checkpoint directory is required")
    if not isinstance(label_budget, int) or isinstance(label_budget, bool) or label_budget < 1:
        raise GrpoError(f"{where}.label_budget must be an integer >= 1, got {label_budget!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise GrpoError(f"{where}.batch_size must be an integer >= 1, got {batch_size!r}")
    if not isinstance(max_length, int) or max_length < 2:
        raise GrpoError(f"{where}.max_length must be an integer >= 2, got {max_length!r}")
    if pairs not in PAIRINGS:
        raise GrpoError(f"{where}.pairs must be one of {', '.join(PAIRINGS)}, got {pairs!r}")
    for key, value, least in (
        ("updates", updates, 1),
        ("replay", replay, 0),
        ("replay_size", replay_size, 1),
        ("rehearsal", rehearsal, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise GrpoError(f"{where}.{key} must be an integer >= {least}, got {value!r}")
    if not (isinstance(center_coef, (int, float)) and center_coef >= 0):
        raise GrpoError(f"{where}.center_coef must be >= 0, got {center_coef!r}")
    kwargs = dict(labeller_kwargs or {})
    fn = LABELLERS.get(labeller)
    LABELLERS.check_params(labeller, kwargs, {"row", "completion_a", "completion_b"})

    def ask(row: dict, a: str, b: str) -> float:
        inputs = {"row": row, "completion_a": a, "completion_b": b, **kwargs}
        return LABELLERS.call(fn, inputs)

    if not isinstance(label_first, bool):
        raise GrpoError(f"{where}.label_first must be true or false, got {label_first!r}")
    if bool(rehearsal) != bool(rehearsal_data):
        raise GrpoError(
            f"{where}: rehearsal ({rehearsal!r}) and rehearsal_data ({rehearsal_data!r}) go "
            "together: the pairs per update, and the preference data they come from"
        )
    tokenizer = load_tokenizer(init)
    rehearsal_pairs = None
    if rehearsal_data:
        from grpo.data.preferences import load_preference_rows, preference_pairs

        source = f"{where}.rehearsal_data {rehearsal_data!r} ({rehearsal_split})"
        rows = load_preference_rows(rehearsal_data, rehearsal_split)
        rehearsal_pairs, _ = preference_pairs(rows, tokenizer, max_length, source)
        if not rehearsal_pairs:
            raise GrpoError(f"{source}: no pair fits max_length ({max_length})")
    model = load_model(init, dtype=config.model.dtype, device=policy.device)
    if model.config.num_labels != 1:
        raise GrpoError(f"{where}.init: {init} is not a reward model (one output, `grpo rm`)")
    for p in model.parameters():
        p.requires_grad_(True)
    policy.precision.prepare(model)  # what trains in float32
    model.eval()
    return OnlineRewardModel(
        model,
        tokenizer,
        ask,
        label_budget,
        dist,
        policy.precision,
        config.train.seed if seed is None else seed,
        batch_size,
        max_length,
        system_prompt,
        float(center_coef),
        pairs,
        updates,
        replay,
        replay_size,
        rehearsal,
        rehearsal_pairs,
        label_first,
    )
