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
pairs of two different completions of one prompt (one GRPO group), uniformly among the pairs of
the batch whose texts differ, asks the labeller at most `label_budget` times, and takes one
Bradley-Terry step on the labelled pairs (`grpo.algo.preference.pair_loss`, the loss `grpo rm`
trains with). The rewards of a step come from the reward model before it learns from that
step's labels.

A labeller is ``labeller(row, completion_a, completion_b, **labeller_kwargs) -> number``:
> 0 prefers a, < 0 prefers b, 0 (a tie) gives no pair (the call still counts against the
budget). `verifier` (here) asks a reward function, by default the strict `accuracy` rule,
standing in for a person; ``{reward: judge, reward_kwargs: {...}}`` asks an LLM judge
(`grpo.rewards.judge`); a plug-in is any ``package.module:function`` or a name given to
`register_labeller`.

State: the model's weights, and the counters ``steps`` (updates taken) and ``labels`` (labeller
calls so far) as int64 tensors in the module's checkpoint state; the pair draws of a step come
from a generator seeded with (seed, rank, steps), so a resumed run draws the same pairs as an
uninterrupted one. Under torchrun every rank labels its own rows, the budget split over the
ranks (the first budget % world ranks one more), and the loss is the mean over the labelled
pairs of the global batch. Every weight trains (full fine-tuning: no LoRA).
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any

import torch

from grpo.algo.preference import collate_pairs, pair_loss
from grpo.algo.registry import Registry
from grpo.distributed import all_reduce_sum
from grpo.errors import GrpoError
from grpo.models.classifier import sequence_scores
from grpo.modules.base import TrainedModule, register_trained_module

if TYPE_CHECKING:
    from grpo.policy import Policy

LABELLERS = Registry("labeller", "modules[online_reward_model].kwargs.labeller")
REWARD_KEY = "online_rm"  # its reward's name: rewards/online_rm


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
    ):
        super().__init__()
        self.model, self.tokenizer, self.labeller = model, tokenizer, labeller
        self.label_budget, self.dist, self.precision, self.seed = (
            label_budget,
            dist,
            precision,
            seed,
        )
        self.batch_size, self.max_length = batch_size, max_length
        self.system_prompt, self.center_coef = system_prompt, center_coef
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
        """This step's pairs (row a, row b), a < b, both of one group and with different
        texts: `budget()` of them (fewer when the batch has fewer), uniformly without
        replacement, from a generator seeded with (seed, rank, steps)."""
        G = batch.rollout.group_size
        texts = batch.texts
        candidates = [
            (g + i, g + j)
            for g in range(0, batch.size - G + 1, G)
            for i in range(G)
            for j in range(i + 1, G)
            if texts[g + i] != texts[g + j]
        ]
        gen = torch.Generator().manual_seed(_seed(self.seed, self.dist.rank, int(self.steps)))
        order = torch.randperm(len(candidates), generator=gen)[: self.budget()].tolist()
        return [candidates[k] for k in order]

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
        """Label this step's pairs and return the Bradley-Terry loss on them (module
        docstring), this rank's share of the mean over the global batch's labelled pairs."""
        drawn = self.draw_pairs(batch)
        labelled = self.label(batch, drawn)
        self.steps += 1
        self.labels += len(drawn)
        dist = self.dist
        n = all_reduce_sum(float(len(labelled)), dist)  # labelled pairs of the global batch
        calls = all_reduce_sum(float(len(drawn)), dist)
        reported = {
            "labels": calls,
            "pairs": n,
            "labels_total": all_reduce_sum(float(self.labels), dist),
        }
        # every rank makes the same collective calls, with or without pairs of its own
        if labelled:
            pairs = collate_pairs(self.encode(batch, labelled), self.pad_id, self.device)
            with self.precision.autocast(self.device):
                scores = sequence_scores(
                    self.model, pairs["ids"], pairs["attention_mask"], self.pad_id
                )[:, 0]  # (2N,): the chosen sides, then the rejected
            k = len(labelled)
            chosen, rejected = scores[:k], scores[k:]
            losses = pair_loss(chosen, rejected, pairs["margin"], self.center_coef)  # (N,)
            # this rank's share of the global mean; ModuleSet averages gradients over ranks
            loss = losses.sum() / n * dist.world_size
            correct = float((chosen > rejected).sum())
        else:  # no pair on this rank: a zero gradient
            loss = sum(p.sum() for p in self.model.parameters() if p.requires_grad) * 0.0
            correct = 0.0
        correct = all_reduce_sum(correct, dist)
        if n:
            reported["pair_accuracy"] = correct / n  # before this update
        return loss, reported


def _question(row: dict) -> str:
    if "question" not in row:
        raise GrpoError(
            "online_reward_model: the rows have no 'question' column (the prompt the reward "
            "model reads with each completion)"
        )
    return str(row["question"])


def _seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed of (seed, rank, step): draws of different steps and ranks independent."""
    digest = hashlib.sha256(f"online_rm|{seed}|{rank}|{step}".encode()).digest()
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
    if not (isinstance(center_coef, (int, float)) and center_coef >= 0):
        raise GrpoError(f"{where}.center_coef must be >= 0, got {center_coef!r}")
    kwargs = dict(labeller_kwargs or {})
    fn = LABELLERS.get(labeller)
    LABELLERS.check_params(labeller, kwargs, {"row", "completion_a", "completion_b"})

    def ask(row: dict, a: str, b: str) -> float:
        inputs = {"row": row, "completion_a": a, "completion_b": b, **kwargs}
        return LABELLERS.call(fn, inputs)

    model = load_model(init, dtype=config.model.dtype, device=policy.device)
    if model.config.num_labels != 1:
        raise GrpoError(f"{where}.init: {init} is not a reward model (one output, `grpo rm`)")
    for p in model.parameters():
        p.requires_grad_(True)
    policy.precision.prepare(model)  # what trains in float32
    model.eval()
    return OnlineRewardModel(
        model,
        load_tokenizer(init),
        ask,
        label_budget,
        dist,
        policy.precision,
        config.train.seed if seed is None else seed,
        batch_size,
        max_length,
        system_prompt,
        float(center_coef),
    )
