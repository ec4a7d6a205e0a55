"""Modules trained beside the policy: a value head, a learned baseline, a reward model trained
online. Each is a `TrainedModule` made by a factory named in the config:

    modules:
      - name: my_pkg.value:ValueHead       # a registered name or package.module:factory
        kwargs: {dim: 32}
        optim: {lr: 3.0e-3}                # its own AdamW and schedule (optim's keys)

The trainer gives each module what the policy has: its own optimizer and LR schedule (over the
run's updates); data parallelism under torchrun (replicated, under train.parallel: fsdp too, as
modules are small: the same initial weights on every rank, gradients averaged over the ranks in
one all-reduce, as DDP does); the policy's precision (its autocast around `attach` and `loss`);
checkpoints (weights as safetensors, optimizer and schedule states, in the step's checkpoint)
and exact resume; and a line in the run's metadata (``run/modules``: name, class, parameters).

Each step, after the rollout, `attach` adds per-row tensors to the batch's `extras` (an
estimator that declares `rollout` reads them: `EstimatorRollout.extras`); after the policy's
update, `loss` on the same batch is one optimizer step of the module (its gradient averaged over
ranks, so 2 ranks of equal batches equal one process on both). `loss` may also be a generator
that yields one loss per micro-batch: each is backpropagated as it comes (one graph alive at a
time), the step's loss is their sum. Metrics: ``module/<name>/loss``, ``grad_norm`` and what
`loss` reports (``(loss, {"name": scalar})``), averaged over ranks. A module's initial weights
come from its own seed (train.seed + 1000 + its index), the run's RNG left as it was.

A factory takes its `kwargs` and any of these inputs by name: ``model_config`` (the policy's
`ModelConfig`), ``tokenizer``, ``config`` (the run's `Config`), ``dist`` (the trainer ranks'
`grpo.distributed.Dist`, for a loss normalized over the global batch), ``policy`` (the
`grpo.policy.Policy`, e.g. to share its frozen weights) and ``scoring`` (the trainer's
`grpo.experience.scoring.Scoring`: completion log-probs of any model with the trainer's
micro-batches, packing, precision and kernel). The PPO critic (`grpo.modules.critic`) is one
such module.

A `FrozenScorer` (grpo.modules.base) only attaches: it gets no optimizer (an `optim` section is
refused), its parameters are frozen, `step` passes it by; checkpoints hold its state (none by
default) and its identity (`identity.json`: the teacher's checkpoint hash), and a resume with
another identity is refused; the metadata line names it ``frozen``. The distillation teacher
(`grpo.modules.teacher`) is one.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpo.errors import GrpoError
from grpo.experience.scoring import Scoring
from grpo.io import (
    load_safetensors,
    read_json,
    save_safetensors,
    torch_load,
    torch_save,
    write_text,
)
from grpo.metrics import split_metrics
from grpo.modules import critic as _critic  # noqa: F401  (registers the PPO critic, "critic")
from grpo.modules import online_rm as _online_rm  # noqa: F401  ("online_reward_model")
from grpo.modules import teacher as _teacher  # noqa: F401  (registers "teacher")
from grpo.modules.base import (
    TRAINED_MODULES,
    FrozenScorer,
    TrainedModule,
    register_trained_module,
)
from grpo.plugins import named_errors, no_exit, time_limit
from grpo.run.optim import build_optimizer, build_scheduler

if TYPE_CHECKING:
    from grpo.policy import Policy

_DONE = object()  # the end of a module's loss parts
INPUTS = ("model_config", "tokenizer", "config", "dist", "policy", "scoring")


def _builtin(module) -> bool:
    """A module of grpo's own (the critic): its errors keep their traceback (a bug of ours);
    a plug-in's are one line naming it (`grpo.plugins.named_errors`)."""
    return type(module).__module__.startswith("grpo.")


def check_trained_module(spec, index: int = 0) -> None:
    """Fail early, naming the field, on what the config alone shows cannot work: an unknown
    factory, a keyword it does not take, a keyword whose value is not of the type the
    factory's signature annotates (`check_kwarg_types`), then the factory's own
    ``check_kwargs(kwargs, field)`` when it has one (the critic's: value ranges)."""
    try:
        TRAINED_MODULES.check_params(spec.name, spec.kwargs, set(INPUTS))
    except GrpoError as e:  # the registry's field names, made this entry's
        text = str(e).replace("modules[].name_kwargs", f"modules[{index}].kwargs")
        raise GrpoError(text.replace("modules[].name", f"modules[{index}].name")) from None
    factory = TRAINED_MODULES.get(spec.name)
    field = f"modules[{index}].kwargs"
    check_kwarg_types(factory, spec.kwargs, field)
    check = getattr(factory, "check_kwargs", None)
    if callable(check):
        with no_exit(f"{field}: {spec.name!r} check_kwargs"):
            check(dict(spec.kwargs), field)


# the annotations `check_kwarg_types` reads; any other one (a class, Any, Literal) is not checked
_PLAIN = {int: "int", float: "float", str: "str", bool: "bool", dict: "mapping", list: "list"}
_PLAIN |= {tuple: "list", type(None): "null"}


def check_kwarg_types(factory, kwargs: dict, field: str) -> None:
    """Each of `kwargs` whose parameter `factory` annotates with plain types (int, float, str,
    bool, dict, list, tuple, None and their unions: ``int | None``) holds one of them (an int
    passes for a float; a bool only for a bool), so that ``micro_batch_size: 'x'`` is one line
    at `grpo config`, not a traceback once the model has loaded. Annotations it cannot read
    are not checked.

    Raises:
        GrpoError: ``<field>.<key>: expected int or null, got str 'x'``.
    """
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    scope = vars(inspect.getmodule(factory) or inspect)
    for key, value in kwargs.items():
        p = params.get(key)
        if p is None or p.annotation is p.empty:
            continue
        allowed = _allowed_types(p.annotation, scope)
        if allowed is None or _fits(value, allowed):
            continue
        names = " or ".join(dict.fromkeys(_PLAIN[t] for t in _PLAIN if t in allowed))
        raise GrpoError(f"{field}.{key}: expected {names}, got {type(value).__name__} {value!r}")


def _allowed_types(annotation, scope: dict) -> set | None:
    """The plain types an annotation (a string under `from __future__ import annotations`)
    allows, or None when it names anything else."""
    if isinstance(annotation, str):  # resolved in the factory's module, as typing does
        holder = types.SimpleNamespace(__annotations__={"value": annotation})
        try:
            annotation = typing.get_type_hints(holder, globalns=scope)["value"]
        except Exception:  # a name only imported under TYPE_CHECKING, say: not checked
            return None
    if annotation is None:
        return {type(None)}
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        out: set = set()
        for arg in typing.get_args(annotation):
            got = _allowed_types(arg, scope)
            if got is None:
                return None
            out |= got
        return out
    base = origin if origin is not None else annotation
    return {base} if base in _PLAIN else None


def _fits(value, allowed: set) -> bool:
    if value is None:
        return type(None) in allowed
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int):
        return int in allowed or float in allowed
    for t in (float, str, dict):
        if isinstance(value, t):
            return t in allowed
    if isinstance(value, (list, tuple)):
        return list in allowed or tuple in allowed
    return True  # another object (a config built in Python): not the YAML's to check


@dataclasses.dataclass
class Trained:
    """One module with its optimizer and schedule (None for a frozen scorer)."""

    name: str
    module: TrainedModule
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    max_grad_norm: float | None

    @property
    def frozen(self) -> bool:
        return self.optimizer is None


class ModuleSet:
    """The run's modules (possibly none): built from `cfg.modules`, the trained ones stepped,
    all saved into checkpoints and restored from them."""

    def __init__(self, cfg, policy: Policy, dist, device, total_steps: int):
        self.items: list[Trained] = []
        self.precision, self.device = policy.precision, device
        self.timeout_s = cfg.train.plugin_timeout_s  # one call of a module's loss
        seen = set()
        scoring = Scoring(cfg, policy, dist)
        for i, spec in enumerate(cfg.modules):
            name = spec.key
            if name in seen:
                raise GrpoError(f"modules[{i}]: two modules named {name!r}; give one a `label`")
            seen.add(name)
            inputs = {
                "model_config": policy.model.config,
                "tokenizer": policy.tokenizer,
                "config": cfg,
                "dist": dist,
                "policy": policy,
                "scoring": scoring,
                **spec.kwargs,
            }
            with torch.random.fork_rng(devices=[]):  # its own init; the run's RNG untouched
                torch.manual_seed(cfg.train.seed + 1000 + i)
                module = TRAINED_MODULES.call(spec.name, inputs)
            if not isinstance(module, TrainedModule):
                raise GrpoError(
                    f"modules[{i}]: {spec.name!r} made a {type(module).__name__}, "
                    "not a grpo.modules.TrainedModule"
                )
            module = module.to(device)
            if not getattr(module, "trainable", True):  # a frozen scorer: allowed, nothing trains
                if spec.optim:
                    raise GrpoError(
                        f"modules[{i}].optim: {name!r} is a frozen scorer "
                        f"({type(module).__name__}): nothing of it trains; remove `optim`"
                    )
                module.requires_grad_(False).eval()
                self.items.append(Trained(name, module, None, None, None))
                continue
            optim = type(cfg.optim)(**spec.optim)  # OptimConfig's defaults, then its own
            params = [p for p in module.parameters() if p.requires_grad]
            if not params:  # known only once it is built: still before anything is written
                raise GrpoError(
                    f"modules[{i}]: {name!r} ({type(module).__name__}, from {spec.name!r}) has "
                    "no trainable parameters (none with requires_grad): nothing for its "
                    "optimizer to train; a module that only attaches values subclasses "
                    "grpo.modules.FrozenScorer"
                )
            optimizer = build_optimizer(params, optim)
            scheduler = build_scheduler(optimizer, total_steps * _updates(module), optim)
            self.items.append(Trained(name, module, optimizer, scheduler, optim.max_grad_norm))
        if cfg.train.critic_warmup_steps and cfg.modules and all(t.frozen for t in self.items):
            raise GrpoError(
                f"train.critic_warmup_steps ({cfg.train.critic_warmup_steps}) needs a module "
                "that trains; every module here is a frozen scorer"
            )
        self.dist = dist
        self._first: dict[str, dict[str, float]] = {}  # `attach`'s early updates' metrics
        if dist.enabled:  # the same initial weights on every rank, as DDP broadcasts them
            import torch.distributed as td

            src = 0 if dist.group is None else td.get_global_rank(dist.group, 0)
            # without grad: a trainable parameter broadcast in place under autograd puts
            # c10d's broadcast_, which has no backward, into the graph of every later step
            # (torch warns at each rank's backward: "may lead to silently incorrect behavior")
            with torch.no_grad():
                for t in self.items:
                    for tensor in t.module.checkpoint_state().values():
                        td.broadcast(tensor, src=src, group=dist.group)

    def __bool__(self) -> bool:
        return bool(self.items)

    def header(self) -> dict[str, str]:
        """``run/modules``: each module's name, class and trainable parameter count; a frozen
        scorer's identity (``frozen``, e.g. its checkpoint and hash)."""
        if not self.items:
            return {}
        parts = []
        for t in self.items:
            cls = type(t.module)
            what = f"{cls.__module__}.{cls.__qualname__}"
            if t.frozen:
                ident = "".join(f", {k}={v}" for k, v in _identity(t).items())
                parts.append(f"{t.name} ({what}, frozen{ident})")
                continue
            n = sum(p.numel() for p in t.module.parameters() if p.requires_grad)
            parts.append(f"{t.name} ({what}, {n} parameters)")
        return {"run/modules": "; ".join(parts)}

    @property
    def gives_rewards(self) -> bool:
        """Whether a module gives rewards (overrides `TrainedModule.rewards`)."""
        return any(type(t.module).rewards is not TrainedModule.rewards for t in self.items)

    def attach(self, batch):
        """The batch with every module's per-row tensors added to its extras and the rewards
        modules give added to its rewards (`TrainedModule.rewards`); a module that trains first
        (`TrainedModule.trains_first`) takes its optimizer steps on the batch before."""
        if not self.items:
            return batch
        self._first = {}  # the updates of modules that train first, for `step` to report
        for t in self.items:
            if not t.frozen and getattr(t.module, "trains_first", False):
                self._first[t.name] = self._train(t, batch, None, None)
        extras = dict(batch.extras)
        given: dict[str, torch.Tensor] = {}
        for t in self.items:
            t.module.eval()
            what, ours = f"module {t.name!r} attach", _builtin(t.module)
            with torch.no_grad(), self.precision.autocast(self.device), no_exit(what):
                with time_limit(what, self.timeout_s), named_errors(what, builtin=ours):
                    made = t.module.attach(batch) or {}
                    rewards = t.module.rewards(batch) or {}
            for k, v in made.items():
                if not isinstance(v, torch.Tensor) or v.shape[0] != batch.size or v.dim() > 2:
                    raise GrpoError(
                        f"module {t.name!r}: attach returned {k!r} of "
                        f"{_shape(v)}; expected (B,) or (B, T_c) with B = "
                        f"{batch.size}"
                    )
                extras[k] = v.float() if v.is_floating_point() else v
            for k, v in rewards.items():
                ok = isinstance(v, torch.Tensor) and tuple(v.shape) == (batch.size,)
                if not ok or k in batch.per_fn or k in given:
                    why = "a name already taken" if ok else f"{_shape(v)}; expected (B,)"
                    raise GrpoError(
                        f"module {t.name!r}: rewards returned {k!r} of {why} (B = {batch.size})"
                    )
                if not bool(torch.isfinite(v).all()):
                    raise GrpoError(f"module {t.name!r}: reward {k!r} is not finite")
                given[k] = v.float().to(batch.rewards.device)
        batch = dataclasses.replace(batch, extras=extras)
        return _with_rewards(batch, given) if given else batch

    def step(self, batch, update, step: int | None = None) -> dict[str, float]:
        """`updates` optimizer steps of every module on the step's batch; their metrics (the
        means over those updates)."""
        out: dict[str, float] = {}
        first = self._first
        for t in self.items:
            if t.frozen:  # a frozen scorer only attaches
                continue
            if t.name in first:  # trained before `attach` (`TrainedModule.trains_first`)
                out.update(first.pop(t.name))
                continue
            out.update(self._train(t, batch, update, step))
        return out

    def _train(self, t: Trained, batch, update, step: int | None) -> dict[str, float]:
        """`updates` optimizer steps of `t`; its metrics, the means over them."""
        t.module.train()
        n = _updates(t.module)
        sums: dict[str, float] = {}
        for _ in range(n):
            for k, v in self._update(t, batch, update, step).items():
                sums[k] = sums.get(k, 0.0) + v
        t.module.eval()
        return {f"module/{t.name}/{k}": v / n for k, v in sums.items()}

    def _update(self, t: Trained, batch, update, step: int | None) -> dict[str, float]:
        """One optimizer step of `t`: its loss, grad_norm and reported metrics."""
        t.optimizer.zero_grad(set_to_none=True)
        total, reported = 0.0, {}
        for loss, got in self._losses(t, batch, update):  # forwards under autocast
            loss.float().backward()  # one micro-batch's graph at a time
            total = total + loss.detach().float()
            reported.update(got)
        params = [p for p in t.module.parameters() if p.requires_grad]
        _average_gradients(params, self.dist)  # DDP: the mean of every rank's gradient
        norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm or math.inf)
        value = float(total)
        if not (math.isfinite(value) and math.isfinite(float(norm))):
            where = f"step {step}: " if step is not None else ""
            raise GrpoError(
                f"{where}module {t.name!r}: non-finite loss ({value}) or gradient "
                f"norm ({float(norm)})"
            )
        t.optimizer.step()
        t.scheduler.step()
        return {"loss": value, "grad_norm": float(norm), **reported}

    def _losses(self, t: Trained, batch, update):
        """(loss, metrics) of each of `t`'s loss parts (one, or what its generator yields),
        each computed under the policy's autocast, checked."""
        what, limit = f"module {t.name!r} loss", self.timeout_s
        ours = _builtin(t.module)

        with self.precision.autocast(self.device), no_exit(what), time_limit(what, limit):
            with named_errors(what, builtin=ours):
                result = t.module.loss(batch, update)
        parts = iter(result) if inspect.isgenerator(result) else iter((result,))
        while True:  # a generator's part runs in next()
            with self.precision.autocast(self.device), no_exit(what), time_limit(what, limit):
                with named_errors(what, builtin=ours):
                    part = next(parts, _DONE)
            if part is _DONE:
                return
            loss, got = split_metrics(part, f"module {t.name!r}")
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
                raise GrpoError(
                    f"module {t.name!r}: loss returned {_shape(loss)}; expected a "
                    "0-d tensor with a gradient"
                )
            yield loss, {k: float(v) for k, v in got.items()}

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, directory: Path, weights_only: bool = False) -> None:
        """modules/<name>/{weights.safetensors, optimizer.pt, scheduler.pt} under `directory`
        (a checkpoint being written; the final weights: `weights_only`)."""
        for t in self.items:
            d = Path(directory) / "modules" / t.name
            d.mkdir(parents=True, exist_ok=True)
            state = t.module.checkpoint_state()
            weights = {k: v.detach().contiguous() for k, v in state.items()}
            save_safetensors(weights, d / "weights.safetensors")
            if t.frozen:  # what identifies it: a resume checks it (`load`)
                write_text(d / "identity.json", json.dumps(_identity(t), sort_keys=True))
                continue
            if weights_only:
                continue
            torch_save(t.optimizer.state_dict(), d / "optimizer.pt")
            torch_save(t.scheduler.state_dict(), d / "scheduler.pt")

    def load(self, checkpoint: Path) -> None:
        """Each module's state from a checkpoint (refused, naming it, when one is missing)."""
        for t in self.items:
            d = Path(checkpoint) / "modules" / t.name
            if not (d / "weights.safetensors").is_file():
                raise GrpoError(
                    f"checkpoint {checkpoint} has no state of module {t.name!r} "
                    "(was it trained with this module?)"
                )
            weights = load_safetensors(d / "weights.safetensors")
            try:
                t.module.load_checkpoint_state(weights)
            except RuntimeError as e:
                first = str(e).strip().splitlines()[0]
                raise GrpoError(
                    f"checkpoint {checkpoint}: module {t.name!r} does not fit: {first}"
                ) from None
            t.module.to(self.device)
            if t.frozen:
                _check_identity(t, d, checkpoint)
                continue
            opt = torch_load(
                d / "optimizer.pt", "a module's optimizer state", map_location=self.device
            )
            t.optimizer.load_state_dict(opt)
            sched = torch_load(
                d / "scheduler.pt", "a module's schedule state", map_location=self.device
            )
            t.scheduler.load_state_dict(sched)


def _identity(t: Trained) -> dict[str, str]:
    """A frozen scorer's `identity()`, checked: a mapping of strings."""
    ident = t.module.identity() if isinstance(t.module, FrozenScorer) else {}
    if not isinstance(ident, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in ident.items()
    ):
        raise GrpoError(f"module {t.name!r}: identity() must return a dict of strings")
    return ident


def _check_identity(t: Trained, d: Path, checkpoint: Path) -> None:
    """A resumed frozen scorer must be the one the checkpoint was written with."""
    path = d / "identity.json"
    saved = read_json(path, "a frozen module's identity") if path.is_file() else {}
    now = _identity(t)
    if saved != now:
        diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        k = diff[0]
        raise GrpoError(
            f"checkpoint {checkpoint}: module {t.name!r} was run with {k}={saved.get(k)}, this "
            f"run has {k}={now.get(k)}: resume with the same frozen scorer"
        )


def _with_rewards(batch, given: dict[str, torch.Tensor]):
    """`batch` with the (B,) rewards `given` added: to `rewards`, to `token_rewards` on each
    row's last generated token, to `per_fn` by name; `frac_zero_std` of the new totals."""
    from grpo.algo.advantages import zero_std_groups

    total = sum(given.values())  # (B,)
    generated = batch.rollout.generated_mask  # (B, T_c)
    cols = torch.arange(generated.shape[1], device=generated.device)
    last = (cols * generated).argmax(-1)  # (B,) the last generated token (0 with none)
    tokens = batch.token_rewards.clone()
    tokens[torch.arange(batch.size, device=tokens.device), last] += total.to(tokens.device)
    rewards = batch.rewards + total
    G = batch.rollout.group_size
    return dataclasses.replace(
        batch,
        rewards=rewards,
        token_rewards=tokens,
        per_fn={**batch.per_fn, **given},
        frac_zero_std=float(zero_std_groups(rewards, G).float().mean())
        if batch.size % G == 0
        else batch.frac_zero_std,
    )


def _updates(module: TrainedModule) -> int:
    """A module's optimizer steps per training step (`TrainedModule.updates`), checked."""
    n = getattr(module, "updates", 1)
    if not isinstance(n, int) or n < 1:
        raise GrpoError(f"{type(module).__name__}.updates must be an int >= 1, got {n!r}")
    return n


def _average_gradients(params: list[torch.Tensor], dist) -> None:
    """DDP's reduction, explicitly: every rank's gradients averaged, in one all-reduce of
    their concatenation (modules are small; a parameter without a gradient counts as 0)."""
    if not dist.enabled:
        return
    import torch.distributed as td

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    td.all_reduce(flat, op=td.ReduceOp.SUM, group=dist.group)
    flat /= dist.world_size
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
        offset += n


def _shape(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return type(v).__name__


__all__ = [
    "TRAINED_MODULES",
    "FrozenScorer",
    "ModuleSet",
    "TrainedModule",
    "check_trained_module",
    "register_trained_module",
]
