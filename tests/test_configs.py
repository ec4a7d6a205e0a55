"""Every file in configs/ runs as written: one step of each on a tiny model on the CPU, with the
config's own dtype, autocast, LoRA, gradient checkpointing, shared-prefix and compile settings;
only the model path, the data source, the sizes and the lengths are overridden. (The demo
files run in tests/test_demo.py and tests/test_gsm8k_tools.py, pipeline_tiny in
tests/test_pipeline.py.) CPU autocast is
bf16, so the tutorial's fp32 + bf16-autocast + LoRA configs meet what they meet on a GPU.

Plus the end-to-end bf16 matrix: one GRPO step under bf16 autocast for each of LoRA on/off x
compiled decode on/off x shared prefix on/off x single turn / multi-turn tools."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import yaml

from grpo.config import load_config
from grpo.models.config import ModelConfig
from grpo.train.grpo import train_grpo
from grpo.train.sft import train_sft

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# the vendored GSM8K test split (tests/data/gsm8k): the suite never needs the shared data folder
GSM8K = REPO / "tests" / "data" / "gsm8k"
GSM8K_SPLIT = ["data.split=test", "data.eval_split=test"]
# Which test runs each config file; a new file fails here until it is given one.
RUN_ELSEWHERE = {
    "demo_cpu.yaml": "tests/test_demo.py::test_demo_quick_writes_every_output",
    "demo_tools_cpu.yaml": "tests/test_demo.py::test_tools_demo_quick_writes_every_output",
    "demo_rlhf_cpu.yaml": "tests/test_demo.py::test_rlhf_demo_quick_writes_every_output",
    "gsm8k_tools_cpu.yaml": (
        "tests/test_gsm8k_tools.py::test_gsm8k_tools_demo_quick_writes_every_output"
    ),
    "pipeline_tiny.yaml": "tests/test_pipeline.py::test_tiny_pipeline_writes_complete_results",
}
RUN_HERE = (
    "gsm8k_qwen3_0.6b_sft.yaml",
    "gsm8k_qwen3_0.6b_grpo.yaml",
    "pipeline_gsm8k.yaml",
    "gsm8k_qwen3_0.6b_tools.yaml",
    "tiny_ci.yaml",
    "quickstart.yaml",
    "rm_qwen3_0.6b.yaml",
    "gsm8k_qwen3_0.6b_ppo.yaml",
    "distill_tiny.yaml",
)
# Sizes and lengths only: one step, a few rows, short prompts and completions.
SMALL = [
    "train.max_steps=1",
    "data.max_samples=8",
    "data.eval_samples=2",
    "eval.max_samples=2",
    "eval.max_new_tokens=8",
    "rollout.max_new_tokens=12",
    "train.log_every=1",
    "train.progress=false",
]


def test_every_config_file_is_run_by_a_test():
    files = {p.name for p in CONFIGS.glob("*.yaml")}
    assert files == set(RUN_ELSEWHERE) | set(RUN_HERE)


def settings(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def check_metrics(out: Path, steps: int = 1) -> dict:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in recs if r.get("step") == steps][-1]
    for k, v in last.items():
        if isinstance(v, float) and not k.startswith("eval/"):
            assert math.isfinite(v), (k, v)
    return last


@pytest.fixture(scope="module")
def gsm8k_sft(shared_tiny_model, tmp_path_factory):
    """configs/gsm8k_qwen3_0.6b_sft.yaml for one step: fp32 weights, bf16 autocast, LoRA,
    gradient checkpointing, as written."""
    out = tmp_path_factory.mktemp("gsm8k_sft") / "run"
    cfg = load_config(
        CONFIGS / "gsm8k_qwen3_0.6b_sft.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"data.source={GSM8K}",
            *GSM8K_SPLIT,
            f"train.output_dir={out}",
            "train.epochs=null",
            "train.batch_size=2",
            *SMALL,
        ],
    )
    assert cfg.model.autocast_bf16 and cfg.lora.enabled and cfg.model.gradient_checkpointing
    assert cfg.model.dtype == settings("gsm8k_qwen3_0.6b_sft.yaml")["model"]["dtype"]
    summary = train_sft(cfg)
    return out, summary


def test_gsm8k_sft_config_runs(gsm8k_sft):
    out, summary = gsm8k_sft
    assert summary["step"] == 1 and (out / "final" / "adapter_model.safetensors").is_file()
    assert check_metrics(out)["train/grad_norm"] > 0


def test_gsm8k_grpo_config_runs_from_the_sft_adapter(gsm8k_sft, shared_tiny_model, tmp_path):
    """As the tutorial runs it: GRPO from SFT's adapter (merged at load: also the reference)."""
    sft_out, _ = gsm8k_sft
    out = tmp_path / "run"
    cfg = load_config(
        CONFIGS / "gsm8k_qwen3_0.6b_grpo.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"model.adapter={sft_out / 'final'}",
            f"data.source={GSM8K}",
            *GSM8K_SPLIT,
            f"train.output_dir={out}",
            *SMALL,
        ],
    )
    assert cfg.model.autocast_bf16 and cfg.lora.enabled and cfg.model.gradient_checkpointing
    assert train_grpo(cfg)["step"] == 1
    m = check_metrics(out)
    assert m["train/grad_norm"] > 0
    assert m["rollout/logprob_diff_max"] <= 1e-2  # bf16 budget (tests/test_precision.py)


def test_gsm8k_ppo_config_runs_from_the_sft_adapter(gsm8k_sft, shared_tiny_model, tmp_path):
    """The PPO recipe from SFT's adapter: GAE, KL in the reward, the critic on the policy's
    base; one step past its critic-only warm-up (the warm-up shortened to 1 step)."""
    sft_out, _ = gsm8k_sft
    out = tmp_path / "run"
    cfg = load_config(
        CONFIGS / "gsm8k_qwen3_0.6b_ppo.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"model.adapter={sft_out / 'final'}",
            f"data.source={GSM8K}",
            *GSM8K_SPLIT,
            f"train.output_dir={out}",
            *SMALL,
            "train.max_steps=2",
            "train.critic_warmup_steps=1",
        ],
    )
    assert cfg.loss.advantage == "gae" and cfg.modules[0].name == "critic"
    assert cfg.model.autocast_bf16 and cfg.lora.enabled
    assert train_grpo(cfg)["step"] == 2
    first, m = check_metrics(out, 1), check_metrics(out, 2)
    assert first["train/policy_frozen"] == 1.0 and "train/policy_frozen" not in m
    assert m["train/grad_norm"] > 0 and m["module/critic/grad_norm"] > 0
    assert m["rollout/logprob_diff_max"] <= 1e-2  # bf16 budget (tests/test_precision.py)


def test_rm_config_runs(shared_tiny_model, tmp_path):
    """configs/rm_qwen3_0.6b.yaml for one step on pairs in the hub dataset's form (chosen /
    rejected conversations), a local file in its place: LoRA + the head, bf16 autocast,
    gradient checkpointing, a held-out evaluation; final/ a sequence classifier."""
    from grpo.train.rm import train_rm

    rows = [
        {
            "chosen": [
                {"role": "user", "content": f"Is {i} even?"},
                {"role": "assistant", "content": "yes" if i % 2 == 0 else "no"},
            ],
            "rejected": [
                {"role": "user", "content": f"Is {i} even?"},
                {"role": "assistant", "content": "no" if i % 2 == 0 else "yes"},
            ],
        }
        for i in range(12)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    cfg = load_config(
        CONFIGS / "rm_qwen3_0.6b.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"data.dataset={data}",
            "data.split=train[:8]",
            "data.eval_split=train[8:]",
            f"train.output_dir={out}",
            "train.epochs=null",
            "train.batch_size=4",
            "train.micro_batch_size=2",
            "rm.max_length=128",
            *SMALL,
        ],
    )
    assert cfg.model.autocast_bf16 and cfg.lora.enabled and cfg.model.gradient_checkpointing
    assert train_rm(cfg)["step"] == 1
    m = check_metrics(out)
    assert m["train/grad_norm"] > 0 and m["eval/pairs"] == 2
    arch = json.loads((out / "final" / "config.json").read_text())["architectures"]
    assert arch == ["Qwen3ForSequenceClassification"]


def test_gsm8k_qwen3_tools_config_runs(tmp_path):
    """configs/gsm8k_qwen3_0.6b_tools.yaml for one step: python episodes started by the
    environment, the tool schema rendered by the chat template (the tiny model gets a context
    that holds it: ~500 tokens of schema with its 384-token vocabulary)."""
    from grpo.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", size="ci", max_position_embeddings=2048)
    out = tmp_path / "run"
    cfg = load_config(
        CONFIGS / "gsm8k_qwen3_0.6b_tools.yaml",
        [
            f"model.path={model}",
            f"data.source={GSM8K}",
            *GSM8K_SPLIT,
            f"train.output_dir={out}",
            *SMALL,
            "train.batch_size=8",
            "train.micro_batch_size=4",
            "rollout.group_size=4",
            "rollout.max_obs_tokens=16",
            "rollout.max_total_tokens=64",
        ],
    )
    assert cfg.model.autocast_bf16 and cfg.lora.enabled and cfg.model.gradient_checkpointing
    assert cfg.rollout.env == "python" and cfg.rollout.env_kwargs["use_template_tools"]
    assert train_grpo(cfg)["step"] == 1
    m = check_metrics(out)
    assert 1 <= m["env/turns_mean"] <= cfg.rollout.max_turns
    assert m["rollout/logprob_diff_max"] <= 1e-2  # bf16 budget (tests/test_precision.py)
    # the sandbox the code ran in, as the run's header records it (docs/safety.md)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    from grpo.envs import isolation

    assert json.loads(first["run/env_isolation"]) == isolation().as_dict()


def test_pipeline_gsm8k_config_runs(shared_tiny_model, tmp_path):
    from tests.test_pipeline import cli

    out = tmp_path / "pipe"
    args = cli(
        [
            "pipeline",
            "--config",
            str(CONFIGS / "pipeline_gsm8k.yaml"),
            f"model.path={shared_tiny_model}",
            f"data.source={GSM8K}",
            f"output_dir={out}",
            *[f"{stage}.{o}" for stage in ("sft", "grpo") for o in GSM8K_SPLIT],
            "sft.train.epochs=null",
            "sft.train.batch_size=2",
            "grpo.rollout.max_new_tokens=8",
            "sft.rollout.max_new_tokens=8",
            "sft.eval.sft_accuracy_threshold=0",  # a random model: let GRPO run too
            *[s for s in SMALL if not s.startswith(("rollout.", "train.log", "train.prog"))],
        ]
    )
    assert args.func(args) == 0
    results = json.loads((out / "training_results.json").read_text())
    assert results["status"] == "completed", results


def test_tiny_ci_config_runs(shared_tiny_model, tmp_path):
    out = tmp_path / "run"
    cfg = load_config(
        CONFIGS / "tiny_ci.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"train.output_dir={out}",
            "train.max_steps=1",
            "train.progress=false",
        ],
    )
    assert train_grpo(cfg)["step"] == 1
    m = check_metrics(out)
    phases = [m[f"perf/peak_mem_{k}_mib"] for k in ("rollout", "logprob", "update")]
    assert min(phases) > 0 and m["perf/peak_mem_mib"] == max(phases)


def test_distill_config_runs(shared_tiny_model, tmp_path):
    """configs/distill_tiny.yaml for one step, with the tiny model as the student and as its
    own teacher (its only module's path replaced, the rest of the entry as written): rewards [],
    the teacher a frozen scorer, the `distill` estimator. A teacher equal to the student scores
    each sampled token as the sampler did: the reverse KL is 0 within the on-policy budget."""
    out = tmp_path / "run"
    entry = settings("distill_tiny.yaml")["modules"][0]
    entry["kwargs"]["path"] = str(shared_tiny_model)
    cfg = load_config(
        CONFIGS / "distill_tiny.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"modules=[{json.dumps(entry)}]",
            f"train.output_dir={out}",
            *SMALL,
        ],
    )
    assert cfg.rewards == () and cfg.loss.advantage == "distill"
    assert train_grpo(cfg)["step"] == 1
    m = check_metrics(out)
    assert abs(m["advantage/reverse_kl"]) <= 1e-4 and m["rollout/logprob_diff_max"] <= 1e-4
    assert "module/teacher/loss" not in m


def test_quickstart_config_learns(shared_tiny_model, tmp_path):
    """configs/quickstart.yaml as written (only the model, the output and the step count
    overridden): a learning signal from step 1 (rewards differ within groups, a non-zero
    gradient at a non-zero lr) and a reward mean that climbs within 15 of its 30 steps."""
    from grpo.run.optim import lr_lambda

    out = tmp_path / "run"
    cfg = load_config(
        CONFIGS / "quickstart.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"train.output_dir={out}",
            "train.max_steps=15",
            "train.progress=false",
        ],
    )
    assert train_grpo(cfg)["step"] == 15
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "rollout/reward_mean" in r]
    first = recs[0]
    assert first["rollout/reward_std"] > 0 and first["rollout/frac_zero_std_groups"] < 1
    assert first["train/grad_norm"] > 0
    # 15 steps, W = round(0.1 * 15) = 2: step 1 runs at lr / 2
    assert first["train/lr"] == pytest.approx(cfg.optim.lr * lr_lambda(0, 15, cfg.optim))
    assert first["train/lr"] == pytest.approx(cfg.optim.lr / 2)
    reward = [r["rollout/reward_mean"] for r in recs]
    assert sum(reward[-3:]) > 3 * sum(reward[:3]), reward


class EchoTool:
    """Two model turns whatever the (random) model writes: the first gets a tool observation
    appended to the KV cache, the second ends the episode."""

    tools: list = []

    def __init__(self):
        self.turns = 0

    def start(self, row):
        return None  # the row's own prompt

    def step(self, text, token_ids):
        from grpo.envs import Step

        self.turns += 1
        if self.turns >= 2:
            return Step(observation=None, reward=0.5, done=True)
        return Step(observation="42", reward=0.1, info={"tool_calls": 1})


def load_model_config(path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((Path(path) / "config.json").read_text()))


def aot_eager_sampler(monkeypatch):
    """rollout.compile=on compiles the decode step through dynamo with the aot_eager backend
    (the same graph capture, static cache and guards as inductor, without seconds of C++)."""
    import grpo.experience.inline as g
    from grpo.rollout import Sampler

    monkeypatch.setattr(
        g, "Sampler", functools.partial(Sampler, compile_options={"backend": "aot_eager"})
    )


# LoRA on/off x compiled decode on/off x shared prefix on/off x single turn / tools; the default
# tier runs the one that meets all four (LoRA, compiled, shared prefix, tools), the process tier
# the other 15
BF16_MATRIX = [
    pytest.param(
        lora,
        compile_,
        shared,
        turns,
        id=f"{'lora' if lora else 'full'}-{compile_}-{shared}-{turns}",
        marks=()
        if (lora, compile_, shared, turns) == (True, "on", "on", "tools")
        else pytest.mark.process,
    )
    for lora in (True, False)
    for compile_ in ("on", "off")
    for shared in ("on", "off")
    for turns in ("single", "tools")
]


@pytest.mark.parametrize("lora, compile_, shared_prefix, turns", BF16_MATRIX)
def test_grpo_step_under_bf16_autocast(
    shared_tiny_model, tmp_path, monkeypatch, lora, compile_, shared_prefix, turns
):
    import grpo.envs.base

    aot_eager_sampler(monkeypatch)
    # registered for this test only (the registry is process-wide)
    monkeypatch.setitem(grpo.envs.base._REGISTERED, "echo_tool_test", EchoTool)
    tools = (
        [
            "rollout.env=echo_tool_test",
            "rollout.max_turns=2",
            "rollout.max_obs_tokens=8",
            "eval.env=single_turn",
        ]
        if turns == "tools"
        else []
    )
    cfg = load_config(
        CONFIGS / "tiny_ci.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"train.output_dir={tmp_path / 'run'}",
            "model.autocast_bf16=true",
            f"lora.enabled={str(lora).lower()}",
            f"rollout.compile={compile_}",
            f"train.shared_prefix={shared_prefix}",
            "train.max_steps=1",
            "train.progress=false",
            "data.eval_samples=0",
            "rollout.max_new_tokens=8",
            "data.max_samples=8",
            "loss.entropy_coef=0.01",  # a gradient even when a random model's rewards are all equal
            *tools,
        ],
    )
    assert train_grpo(cfg)["step"] == 1
    m = check_metrics(tmp_path / "run")
    assert m["rollout/logprob_diff_max"] <= 1e-2 and m["train/grad_norm"] > 0
    # the compiled step's bf16 KV cache during the rollout (freed before the reference and
    # update passes): B x L x 2 x H_kv x S x D x 2 bytes, S a multiple of 64 slots; none eager
    assert {f"perf/kept_mem_{p}_mib" for p in ("rollout", "logprob", "update")} <= set(m)
    c = load_model_config(shared_tiny_model)
    per_slot = 8 * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2
    slots = m["perf/sampler_cache_mib"] * 2**20 / per_slot
    assert (slots > 0 and slots % 64 == 0) if compile_ == "on" else slots == 0, slots
    # the first compiled decode call of the run compiled (perf/compile_s); eager compiles nothing
    assert m["perf/compile_s"] > 0 if compile_ == "on" else m["perf/compile_s"] == 0
    if turns == "tools":  # every trajectory: turn, observation, turn
        assert m["env/turns_mean"] == 2 and m["env/tool_calls_mean"] == 1
