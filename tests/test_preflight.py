"""Preflight (issue 20, item 2): every setting that cannot work with the model or the machine
fails at the start, before a model loads or a file is written, with one line naming the field
and exit code 2; the memory estimate matches its formula and the real tensors' sizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from grpo.apps import cli
from grpo.config import OptimConfig, load_config
from grpo.errors import GrpoError
from grpo.lora import apply_lora
from grpo.models import Decoder, KVCache, ModelConfig
from grpo.run import memory
from grpo.run import preflight as pf
from grpo.settings import ConfigError

REPO = Path(__file__).resolve().parents[1]
TINY_CI = str(REPO / "configs" / "tiny_ci.yaml")
PIPELINE_TINY = str(REPO / "configs" / "pipeline_tiny.yaml")
FAST = ["train.progress=false", "train.max_steps=1", "data.max_samples=8"]

# the STYLE.md tiny shape: L=2, C=64, H=4, H_kv=2, D=16, I=128, V=256
TINY = ModelConfig(
    family="qwen3",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    qk_norm=True,
)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if any checkpoint's weights are read."""
    import grpo.modules.critic  # noqa: F401  binds load_model when imported: to the real one

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the preflight failed")

    monkeypatch.setattr("grpo.models.load_model", refuse)  # what grpo.loading calls


def one_line(code: int, capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- the memory estimate


def test_memory_estimate_follows_its_formula_and_the_real_sizes():
    cfg = load_config(
        None,
        [
            "model.path=m",
            "lora.rank=8",
            "lora.targets=[q_proj, v_proj]",
            "train.batch_size=8",
            "train.micro_batch_size=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=16",
            "data.max_prompt_len=32",
            "data.eval_samples=0",
            "train.shared_prefix=off",
        ],
    )
    est = memory.estimate_memory(cfg, TINY, "grpo")
    model = Decoder(TINY)
    n_params = sum(p.numel() for p in model.parameters())  # 90,496 (tied head counted once)
    assert est.weights == n_params * 4 == 90_496 * 4
    apply_lora(model, rank=8, alpha=16, targets=["q_proj", "v_proj"])
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # per layer: q 8*(64+64) + v 8*(64+32) = 1792; two layers 3584; weights, grads, 2 moments
    assert est.optimizer == n_lora * 4 * 4 == 3584 * 16
    assert est.reference == 0  # LoRA: the reference is the base with adapters off
    # rollout: 8 rows x (32 prompt + 16 new) positions of keys and values, as the sampler's
    # cache allocates them, plus (B, V) fp32 logits and probabilities
    cache = KVCache(2, 8, 2, 48, 16)
    kv = sum(t.numel() * t.element_size() for t in cache.k_layers + cache.v_layers)
    assert est.rollout == kv + 8 * 256 * 4 * 2 == 196_608 + 16_384
    # training: 4 rows x 48 tokens x 2 layers x A, A = 2*64 + 2*4*16 + 2*2*16 + 3*128 = 704,
    # x 4 bytes, plus the 32 MiB log-prob tile
    assert est.training == 4 * 48 * 2 * 704 * 4 + 2**25
    assert est.evaluation == 0
    assert est.total == est.weights + est.optimizer + est.training
    # full fine-tuning with a KL reference: a second copy and AdamW over every weight
    full = load_config(None, ["model.path=m", "lora.enabled=false", "loss.beta=0.04"])
    est_full = memory.estimate_memory(full, TINY, "grpo")
    assert est_full.reference == est_full.weights and est_full.optimizer == 3 * est_full.weights
    # shared prefix: each group's prompt counted once (4 rows = 1 group of G=4)
    shared = load_config(
        None,
        [
            "model.path=m",
            "train.batch_size=8",
            "train.micro_batch_size=4",
            "rollout.max_new_tokens=16",
            "data.max_prompt_len=32",
            "train.shared_prefix=on",
        ],
    )
    tokens = 1 * 32 + 4 * 16
    assert memory.estimate_memory(shared, TINY, "grpo").training == tokens * 2 * 704 * 4 + 2**25
    # gradient checkpointing keeps one C vector per token and layer, plus one layer's A; bf16
    # autocast halves the activations
    ckpt = load_config(
        None,
        [
            "model.path=m",
            "model.gradient_checkpointing=true",
            "model.autocast_bf16=true",
            "train.micro_batch_size=4",
            "rollout.max_new_tokens=16",
            "data.max_prompt_len=32",
            "train.shared_prefix=off",
        ],
    )
    est_ckpt = memory.estimate_memory(ckpt, TINY, "grpo")
    assert est_ckpt.training == 4 * 48 * (2 * 64 + 704) * 2 + 2**25
    # packed micro-batches of at most 500 tokens (train.micro_batch_tokens), and a budget
    # under one group's worst case (32 + 4 x 16 = 96 tokens: it runs alone)
    for budget, tokens in ((500, 500), (50, 96)):
        packed = load_config(
            None,
            [
                "model.path=m",
                "train.batch_size=8",
                f"train.micro_batch_tokens={budget}",
                "rollout.max_new_tokens=16",
                "data.max_prompt_len=32",
            ],
        )
        assert memory.estimate_memory(packed, TINY, "grpo").training == (
            tokens * 2 * 704 * 4 + 2**25
        )


def test_memory_estimate_under_fsdp_is_per_rank():
    """train.parallel: fsdp at W ranks: each rank holds 1/W of the weights, the reference and
    the optimizer states (the bytes bench_fsdp measures), a rollout gathers the whole weights
    back, and a training pass the root and one block (real parameter counts)."""
    over = [
        "model.path=m",
        "lora.enabled=false",
        "loss.beta=0.04",
        "train.batch_size=8",
        "rollout.group_size=4",
        "data.eval_samples=0",
    ]
    ddp = memory.estimate_memory(load_config(None, over), TINY, "grpo", world_size=4)
    fsdp = memory.estimate_memory(
        load_config(None, [*over, "train.parallel=fsdp"]), TINY, "grpo", world_size=4
    )
    assert (fsdp.weights, fsdp.reference, fsdp.optimizer) == (
        ddp.weights // 4,
        ddp.reference // 4,
        ddp.optimizer // 4,
    )
    assert fsdp.rollout == ddp.rollout + ddp.weights - ddp.weights // 4
    model = Decoder(TINY)
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    block = sum(p.numel() for p in model.layers[0].parameters())
    assert fsdp.training == ddp.training + (root + block) * 4  # float32 master weights
    assert fsdp.total < ddp.total
    one = memory.estimate_memory(load_config(None, [*over, "train.parallel=fsdp"]), TINY, "grpo")
    assert one == ddp  # one process trains unsharded


def test_memory_estimate_follows_the_precision_policy():
    """bf16 weights: the frozen base in bf16, float32 master weights for what trains (all of
    it in full fine-tuning), and a bf16 KV cache under autocast: the real tensors' sizes."""
    from grpo.precision import Precision

    base = [
        "model.path=m",
        "model.dtype=bfloat16",
        "rollout.max_new_tokens=16",
        "data.max_prompt_len=32",
        "data.eval_samples=0",
        "train.batch_size=8",
    ]
    for lora in (True, False):
        cfg = load_config(
            None,
            [
                *base,
                f"lora.enabled={str(lora).lower()}",
                "lora.rank=8",
                "lora.targets=[q_proj, v_proj]",
                "loss.beta=0",
            ],
        )
        est = memory.estimate_memory(cfg, TINY, "grpo")
        model = Decoder(TINY).to(torch.bfloat16)
        if lora:
            apply_lora(model, rank=8, alpha=16, targets=["q_proj", "v_proj"])
        else:
            model.requires_grad_(True)
        Precision.from_config(cfg.model).prepare(model)
        frozen = sum(
            p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad
        )
        trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if lora:  # weights: the bf16 base; optimizer: float32 adapters, gradients, 2 moments
            assert est.weights == frozen and est.optimizer == trained * 4
        else:  # weights: float32 master weights; optimizer: their gradients and 2 moments
            assert est.weights == trained and est.optimizer == trained * 3 and frozen == 0
    cfg = load_config(None, [*base, "model.dtype=float32", "model.autocast_bf16=true"])
    prec = Precision.from_config(cfg.model)
    cache = KVCache(2, 8, 2, 48, 16, dtype=prec.kv_dtype)  # bf16 under autocast
    kv = sum(t.numel() * t.element_size() for t in cache.k_layers + cache.v_layers)
    assert memory.estimate_memory(cfg, TINY, "grpo").rollout == kv + 8 * 256 * 4 * 2


def test_memory_check_compares_with_available_memory_and_can_be_skipped(monkeypatch):
    cfg = load_config(None, ["model.path=m", "data.eval_samples=0"])
    est = memory.estimate_memory(cfg, TINY, "grpo")
    fields = memory.memory_fields(cfg)
    monkeypatch.setattr(pf, "available_memory", lambda device: (est.total, "test"))
    pf.check_memory(est, torch.device("cpu"), 1, fields)  # exactly fits
    message = (
        r"^train.micro_batch_size: the run needs an estimated .* x 2 ranks\) but .* "
        r"available \(test\); lower train.micro_batch_size, or set "
        r"train.skip_memory_check=true"
    )
    with pytest.raises(pf.PreflightError, match=message):
        pf.check_memory(est, torch.device("cpu"), 2, fields)  # CPU ranks share the memory
    pf.check_memory(est, torch.device("cuda"), 2, fields)  # one GPU per rank
    packed = load_config(
        None, ["model.path=m", "data.eval_samples=0", "train.micro_batch_tokens=100"]
    )
    assert memory.memory_fields(packed)["training"] == "train.micro_batch_tokens"  # its setting
    monkeypatch.setattr(pf, "available_memory", lambda device: (None, "unknown"))
    pf.check_memory(est, torch.device("cpu"), 2, fields)  # cannot tell: no check


def test_available_memory_reads_meminfo():
    free, where = memory.available_memory(torch.device("cpu"))
    text = Path("/proc/meminfo").read_text()
    line = next(x for x in text.splitlines() if x.startswith("MemAvailable:"))
    assert where == "MemAvailable in /proc/meminfo"
    assert abs(free - int(line.split()[1]) * 1024) < 2**30  # read a moment apart


# ---------------------------------------------------------------- through the commands


def train_cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    """(name, overrides, the start of the message after 'error: ') for `grpo train`."""
    (tmp / "a_file").write_text("x")
    return [
        (
            "eval budget",
            ["data.eval_samples=2", "eval.max_new_tokens=512"],
            "eval.max_new_tokens: 512 new tokens leave no room for a prompt in the model's context "
            "(max_position_embeddings=512 in",
        ),
        (
            "rollout budget",
            ["rollout.max_new_tokens=600", "eval.max_new_tokens=16"],
            "rollout.max_new_tokens: 600 new tokens leave no room",
        ),
        (
            "multi-turn budget",
            ["rollout.env=calculator", "rollout.max_new_tokens=200", "rollout.max_turns=3"],
            "rollout.max_new_tokens (x rollout.max_turns 3 + observations): 760 new tokens",
        ),
        (
            "lora rank",
            ["lora.rank=64"],
            "lora.rank: 64 > the width of layers.0.self_attn.k_proj (64 -> 32); at most 32",
        ),
        (
            "lora targets",
            ["lora.targets=[q_prj]"],
            "lora.targets: ['q_prj'] match no linear layer; available: ['down_proj', ",
        ),
        (
            "generated data",
            ["data.max_samples=1000000"],
            "data.max_samples: 1000000 rows of generated 'minimath' data; at most 100000",
        ),
        (
            "memory",
            ["train.batch_size=1073741824"],
            "train.batch_size: the run needs an estimated ",
        ),
        (
            "output dir",
            [f"train.output_dir={tmp}/a_file/run"],
            f"train.output_dir: '{tmp}/a_file/run' cannot be created: '{tmp}/a_file' is a file",
        ),
        ("infinite lr", ["optim.lr=.inf"], "optim.lr: must be a finite number, got inf"),
        ("nan beta", ["loss.beta=.nan"], "loss.beta: must be a finite number, got nan"),
        ("betas", ["optim.betas=[0.9, 1.0]"], "optim.betas: must both be in [0, 1)"),
        ("eps", ["optim.eps=0"], "optim.eps: must be > 0"),
    ]


def test_train_fails_up_front_naming_the_field(shared_tiny_model, tmp_path, capsys, no_model_load):
    out = tmp_path / "run"
    base = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={shared_tiny_model}",
        f"train.output_dir={out}",
        "data.eval_samples=0",
        *FAST,
    ]
    for name, extra, expect in train_cases(tmp_path):
        err = one_line(cli.main(base + extra), capsys)
        assert err.startswith(f"grpo train: error: {expect}"), (name, err)
        assert not out.exists(), f"{name}: the output directory was created"
        assert not (tmp_path / "a_file" / "run").exists()


def test_sft_fails_up_front_naming_the_field(shared_tiny_model, tmp_path, capsys, no_model_load):
    out = tmp_path / "run"
    base = [
        "sft",
        "--config",
        TINY_CI,
        f"model.path={shared_tiny_model}",
        f"train.output_dir={out}",
        *FAST,
    ]
    cases = [
        (["data.eval_samples=2", "eval.max_new_tokens=600"], "eval.max_new_tokens: 600 new"),
        (["rollout.max_new_tokens=512", "eval.max_new_tokens=16"], "rollout.max_new_tokens: 512"),
        (["lora.rank=33"], "lora.rank: 33 > the width of"),
        (["data.eval_samples=200000"], "data.eval_samples: 200000 rows of generated"),
    ]
    for extra, expect in cases:
        err = one_line(cli.main(base + extra), capsys)
        assert err.startswith(f"grpo sft: error: {expect}"), err
        assert not out.exists()


def test_unwritable_output_dir(tmp_path, monkeypatch):
    pf.check_output_dir(tmp_path / "new" / "deeper", "train.output_dir")  # creatable: fine
    assert not (tmp_path / "new").exists()  # and nothing created
    monkeypatch.setattr(pf.os, "access", lambda path, mode: False)
    with pytest.raises(pf.PreflightError, match=r"^train.output_dir: .* is not writable"):
        pf.check_output_dir(tmp_path / "new", "train.output_dir")


def test_several_problems_in_one_line(shared_tiny_model):
    cfg = load_config(
        TINY_CI, [f"model.path={shared_tiny_model}", "lora.rank=64", "data.max_samples=1000000"]
    )
    with pytest.raises(pf.PreflightError) as info:
        pf.preflight(cfg, "grpo", "cpu")
    message = str(info.value)
    assert message.startswith("lora.rank: 64 > ") and "; data.max_samples: 1000000 rows" in message


def test_skip_memory_check_overrides_only_the_memory_check(shared_tiny_model):
    huge = [f"model.path={shared_tiny_model}", "train.batch_size=1073741824"]
    with pytest.raises(pf.PreflightError, match="^train.batch_size: the run needs"):
        pf.preflight(load_config(TINY_CI, huge), "grpo", "cpu")
    mc = pf.preflight(load_config(TINY_CI, [*huge, "train.skip_memory_check=true"]), "grpo", "cpu")
    assert mc.max_position_embeddings == 512
    with pytest.raises(pf.PreflightError, match="^lora.rank"):  # the rest still runs
        pf.preflight(
            load_config(TINY_CI, [*huge, "train.skip_memory_check=true", "lora.rank=64"]),
            "grpo",
            "cpu",
        )


def test_a_hub_id_reads_only_config_json_and_fails_offline_with_one_line(tmp_path):
    cfg = load_config(
        TINY_CI, ["model.path=no-such-org/no-such-model", f"train.output_dir={tmp_path}/run"]
    )
    with pytest.raises(GrpoError, match="could not fetch model 'no-such-org/no-such-model'"):
        pf.preflight(cfg, "grpo", "cpu")
    cfg = load_config(TINY_CI, [f"model.path={tmp_path}/missing"])
    with pytest.raises(GrpoError, match="is not a directory or a hub id"):
        pf.preflight(cfg, "grpo", "cpu")


def test_float_fields_must_be_finite():
    for override, field in (
        ("rollout.temperature=.inf", "rollout.temperature"),
        ("loss.epsilon_high=.nan", "loss.epsilon_high"),
        ("optim.max_grad_norm=1e999", "optim.max_grad_norm"),
        ("optim.betas=[.nan, 0.9]", "optim.betas[0]"),
    ):
        with pytest.raises(
            ConfigError,
            match=rf"^{field.replace('[', '.').replace(']', '.')}: "
            r"must be a finite number",
        ):
            load_config(None, ["model.path=m", override])
    for kwargs, field in (
        ({"lr": float("inf")}, "optim.lr"),
        ({"eps": float("nan")}, "optim.eps"),
        ({"betas": (0.9, float("inf"))}, "optim.betas"),
    ):
        with pytest.raises(ConfigError, match=f"^{field}: must be a finite number"):
            OptimConfig(**kwargs)


# ---------------------------------------------------------------- once the data is loaded


@pytest.fixture(scope="module")
def short_context_model(shared_tiny_model, tmp_path_factory):
    """The tiny model's weights with a 64-position context (config.json only)."""
    path = tmp_path_factory.mktemp("short") / "model"
    shutil.copytree(shared_tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_prompts_that_do_not_fit_fail_before_anything_is_written(
    shared_tiny_model, short_context_model, tmp_path, capsys
):
    out = tmp_path / "run"
    base = ["--config", TINY_CI, f"train.output_dir={out}", *FAST]
    # GRPO: 500 new tokens leave 12 positions; every chat-templated prompt is longer
    train = ["train", *base, f"model.path={shared_tiny_model}"]
    err = one_line(cli.main([*train, "data.eval_samples=0", "rollout.max_new_tokens=500"]), capsys)
    assert err.startswith(
        "grpo train: error: rollout.max_new_tokens: 500 new tokens leave 12 "
        "positions of the model's context (512) for a prompt, but row 0 of "
        "'minimath' (train) has a "
    )
    assert not out.exists()
    # the evaluation's prompts: found at the start, not after training
    err = one_line(cli.main([*train, "data.eval_samples=2", "eval.max_new_tokens=500"]), capsys)
    assert "eval.max_new_tokens: 500 new tokens leave 12 positions" in err
    assert "row 0 of 'minimath' (test)" in err and not out.exists()
    # SFT: prompt + completion past a 64-position context
    err = one_line(
        cli.main(["sft", *base, f"model.path={short_context_model}", "data.eval_samples=0"]), capsys
    )
    assert "grpo sft: error: rollout.max_new_tokens: row 0 of 'minimath' (train) has a " in err
    assert "positions > the model's context 64" in err and not out.exists()


def test_pipeline_checks_both_stages_before_writing(
    shared_tiny_model, tmp_path, capsys, no_model_load
):
    out = tmp_path / "pipe"
    base = [
        "pipeline",
        "--config",
        PIPELINE_TINY,
        f"model.path={shared_tiny_model}",
        f"output_dir={out}",
    ]
    err = one_line(cli.main([*base, "grpo.lora.rank=64"]), capsys)
    assert err.startswith("grpo pipeline: error: grpo: lora.rank: 64 > the width of")
    assert not out.exists()
    # the evaluation stages' budget, even though the stages train with data.eval_samples=0
    err = one_line(cli.main([*base, "eval.max_new_tokens=600"]), capsys)
    assert err.startswith("grpo pipeline: error: sft: eval.max_new_tokens: 600 new tokens")
    assert not out.exists()
    (tmp_path / "a_file").write_text("x")
    err = one_line(cli.main([*base[:-1], f"output_dir={tmp_path}/a_file/p"]), capsys)
    assert err.startswith("grpo pipeline: error: output_dir: ") and "is a file" in err


def test_eval_command_checks_before_loading(shared_tiny_model, tmp_path, capsys, no_model_load):
    out = tmp_path / "x" / "results.json"
    base = [
        "eval",
        "--model",
        str(shared_tiny_model),
        "--data",
        "minimath:test",
        "--max-samples",
        "2",
        "--out",
        str(out),
    ]
    err = one_line(cli.main([*base, "--max-new-tokens", "600"]), capsys)
    assert err.startswith("grpo eval: error: --max-new-tokens: 600 new tokens leave no room")
    err = one_line(cli.main([*base, "--max-new-tokens", "500"]), capsys)
    assert err.startswith("grpo eval: error: --max-new-tokens: 500 new tokens leave 12 positions")
    err = one_line(cli.main([*base, "--batch-size", "0"]), capsys)
    assert err.startswith("grpo eval: error: --batch-size: must be >= 1, got 0")
    err = one_line(cli.main([*base, "--batch-size", "100000000", "--k", "64"]), capsys)
    assert err.startswith("grpo eval: error: --batch-size: the run needs an estimated")
    assert err.endswith(
        "or pass --skip-memory-check if the estimate is wrong for your data (docs/safety.md)"
    )
    err = one_line(
        cli.main(["eval", "--model", str(shared_tiny_model), "--max-samples", "1000000"]), capsys
    )
    assert err.startswith("grpo eval: error: --max-samples: 1000000 rows of generated data")
    # the environment's options: JSON, an object, known to the environment, only with --env
    env = [*base, "--env", "calculator", "--env-kwargs"]
    err = one_line(cli.main([*env, "{bad"]), capsys)
    assert err.startswith("grpo eval: error: --env-kwargs: not valid JSON")
    err = one_line(cli.main([*env, "[1]"]), capsys)
    assert err.startswith("grpo eval: error: --env-kwargs: expected a JSON object")
    err = one_line(cli.main([*env, '{"tool_rewrd": 1}']), capsys)
    assert "unexpected keyword argument 'tool_rewrd'" in err, err
    err = one_line(cli.main([*base, "--env-kwargs", "{}"]), capsys)
    assert err == "grpo eval: error: --env-kwargs needs --env"
    assert not out.parent.exists()
    # the override: the same rows pass the check without the memory part
    rows = [{"prompt_ids": [1] * 10}]
    mc = ModelConfig.from_hf(shared_tiny_model)
    pf.check_eval_rows(rows, [mc], 16, 10**8, torch.device("cpu"), skip_memory_check=True)
    with pytest.raises(pf.PreflightError, match="^--batch-size: the run needs"):
        pf.check_eval_rows(rows, [mc], 16, 10**8, torch.device("cpu"))
