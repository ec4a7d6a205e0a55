"""LoRA: module math and gradients, freezing, merge / unmerge / disable, PEFT interop, export."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from grpo.errors import GrpoError
from grpo.lora import (
    DEFAULT_TARGETS,
    LoRALinear,
    apply_lora,
    disabled_lora,
    load_adapter,
    lora_modules,
    lora_parameters,
    lora_state_dict,
    merge_command,
    merge_lora,
    save_adapter,
    unmerge_lora,
    unwrap_lora,
)
from grpo.models import load_model

ALL_TARGETS = (*DEFAULT_TARGETS, "lm_head")


def randomize_lora_b(model: nn.Module, seed: int = 1, std: float = 0.05) -> None:
    """Non-zero B, so that every comparison below can actually fail."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * std)


def ids_batch(B: int = 2, T: int = 11, V: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- the module


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_grad", [False, True])
def test_lora_linear_forward_and_grads_match_reference(bias, x_grad):
    torch.manual_seed(0)
    lin = nn.Linear(24, 40, bias=bias)
    m = LoRALinear(lin, rank=4, alpha=8.0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m.lora_b.normal_()
    x = torch.randn(3, 7, 24, requires_grad=x_grad)  # (B, T, in)
    y = m(x)
    # Slow twin: the formula written out, on separate copies of the parameters.
    A = m.lora_a.detach().clone().requires_grad_()
    Bm = m.lora_b.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_(x_grad)
    want = lin(x_ref) + 2.0 * (x_ref @ A.t()) @ Bm.t()
    assert y.shape == (3, 7, 40)
    assert max_diff(y, want) <= 1e-5
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    assert max_diff(m.lora_a.grad, A.grad) <= 1e-5
    assert max_diff(m.lora_b.grad, Bm.grad) <= 1e-5
    if x_grad:
        assert max_diff(x.grad, x_ref.grad) <= 1e-5
    assert m.weight.grad is None and (m.bias is None or m.bias.grad is None)


def test_lora_linear_init_and_dropout_on_branch_only():
    lin = nn.Linear(64, 32)
    m = LoRALinear(lin, rank=8, alpha=16.0, dropout=0.5, generator=torch.Generator().manual_seed(3))
    assert m.weight is lin.weight and m.bias is lin.bias  # reused, not copied
    assert torch.all(m.lora_b == 0)
    # kaiming_uniform(a=sqrt(5)) on (r, in) is U(-1/sqrt(in), 1/sqrt(in)).
    assert m.lora_a.abs().max().item() <= 1 / 64**0.5
    assert m.lora_a.std().item() > 0.5 / (3 * 64) ** 0.5
    with torch.no_grad():
        m.lora_b.normal_()
    x = torch.randn(5, 64)
    m.train()
    torch.manual_seed(7)
    got = m(x)
    torch.manual_seed(7)
    dropped = nn.functional.dropout(x, 0.5, training=True)
    want = lin(x) + 2.0 * dropped @ m.lora_a.t() @ m.lora_b.t()
    assert max_diff(got, want) <= 1e-5
    m.eval()
    assert max_diff(m(x), lin(x) + 2.0 * x @ m.lora_a.t() @ m.lora_b.t()) <= 1e-5


# ---------------------------------------------------------------- injection and freezing


def test_zero_init_equals_base_and_trainable_count(tiny_checkpoints):
    path = tiny_checkpoints("qwen2")  # q/k/v biases
    base, model = load_model(path), load_model(path)
    r = 4
    paths = apply_lora(model, rank=r, alpha=8, seed=0)
    assert len(paths) == 2 * 7 and paths[0] == "layers.0.self_attn.q_proj"
    ids = ids_batch()
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))
    # Trainable = exactly the LoRALinear A/B tensors, r * (in + out) per wrapped layer.
    lora_ids = {id(p) for p in lora_parameters(model)}
    for name, p in model.named_parameters():
        assert p.requires_grad == (id(p) in lora_ids), name
    want = sum(r * (m.in_features + m.out_features) for m in lora_modules(model).values())
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == want
    assert set(lora_state_dict(model)) == {f"{p}.lora_{w}" for p in paths for w in "ab"}


def test_seed_makes_lora_a_reproducible(tiny_checkpoints):
    path = tiny_checkpoints("qwen3")
    a, b, c = load_model(path), load_model(path), load_model(path)
    apply_lora(a, 4, 8, seed=5)
    apply_lora(b, 4, 8, seed=5)
    apply_lora(c, 4, 8, seed=6)
    sa, sb, sc = lora_state_dict(a), lora_state_dict(b), lora_state_dict(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["layers.0.self_attn.q_proj.lora_a"], sc["layers.0.self_attn.q_proj.lora_a"]
    )


def test_apply_lora_errors(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    with pytest.raises(GrpoError, match=r"match no linear layer; available: \['down_proj'"):
        apply_lora(model, 4, 8, targets=("query_key_value",))
    with pytest.raises(GrpoError, match="lora.rank"):
        apply_lora(model, 0, 8)
    with pytest.raises(GrpoError, match="lora.dropout"):
        apply_lora(model, 4, 8, dropout=1.0)
    apply_lora(model, 4, 8)
    with pytest.raises(GrpoError, match="already has LoRA"):
        apply_lora(model, 4, 8)


def test_optimizer_step_leaves_base_bitwise_unchanged(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    apply_lora(model, 4, 8, dropout=0.1, seed=0)
    randomize_lora_b(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2, weight_decay=0.1)
    model.train()
    for _ in range(2):
        loss = model(ids_batch()).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]) and p.grad is None, n
    after = lora_state_dict(model)
    assert all(not torch.equal(after[k], before[k]) for k in before)


def test_gradient_checkpointing_gives_same_lora_grads(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    apply_lora(model, 4, 8, seed=0)
    randomize_lora_b(model)
    model.train()
    grads = []
    for ckpt in (False, True):
        model.gradient_checkpointing = ckpt
        model.zero_grad()
        model(ids_batch()).square().mean().backward()
        grads.append([p.grad.clone() for p in lora_parameters(model)])
    assert all(max_diff(a, b) <= 1e-6 for a, b in zip(*grads))


# ---------------------------------------------------------------- merge, disable, unwrap


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # tied and untied lm_head
def test_merge_unmerge_disable(tiny_checkpoints, family):
    path = tiny_checkpoints(family)
    base, model = load_model(path), load_model(path)
    apply_lora(model, 4, 8, targets=ALL_TARGETS, seed=0)
    randomize_lora_b(model)
    embed = model.embed_tokens.weight.detach().clone()
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ids = ids_batch()
    with torch.no_grad():
        want_base, unmerged = base(ids), model(ids)
        assert max_diff(unmerged, want_base) > 1e-3  # the adapter does something
        with disabled_lora(model):
            assert torch.equal(model(ids), want_base)
        assert torch.equal(model(ids), unmerged)

        merge_lora(model)
        merge_lora(model)  # idempotent
        merged = model(ids)
        assert max_diff(merged, unmerged) <= 1e-5
        assert torch.equal(model.embed_tokens.weight, embed)  # a tied lm_head merge unties
        with disabled_lora(model):  # works when merged: unmerge inside, merge again after
            assert max_diff(model(ids), want_base) <= 1e-5
        assert all(m.merged for m in lora_modules(model).values())
        assert max_diff(model(ids), merged) <= 1e-5

        unmerge_lora(model)
        unmerge_lora(model)  # idempotent
        assert max_diff(model(ids), unmerged) <= 1e-5
        for n, p in model.named_parameters():
            if n in weights:
                assert max_diff(p, weights[n]) <= 1e-6, n
    if family == "qwen3":
        assert model.lm_head.weight is model.embed_tokens.weight  # re-tied exactly


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_unwrap_exports_plain_checkpoint(tiny_checkpoints, tmp_path, family):
    from grpo.models import save_pretrained

    model = load_model(tiny_checkpoints(family))
    apply_lora(model, 4, 8, targets=ALL_TARGETS, seed=0)
    randomize_lora_b(model)
    ids = ids_batch()
    with torch.no_grad():
        want = model(ids)
    paths = unwrap_lora(model)
    assert len(paths) == 2 * 7 + 1 and not lora_modules(model)
    assert type(model.layers[1].mlp.down_proj) is nn.Linear and type(model.lm_head) is nn.Linear
    assert not model.config.tie_word_embeddings
    save_pretrained(model, tmp_path / "merged")
    with torch.no_grad():
        assert max_diff(model(ids), want) <= 1e-5
        assert max_diff(hf_model(tmp_path / "merged")(input_ids=ids).logits, want) <= 1e-5


# ---------------------------------------------------------------- adapter files


def test_adapter_round_trip_and_targets(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints("qwen3")
    model = load_model(path)
    apply_lora(model, 4, 8, dropout=0.05, targets=("layers.1.self_attn.q_proj", "down_proj"))
    randomize_lora_b(model)
    save_adapter(model, tmp_path / "ad", base_model_name_or_path=str(path))
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == (4, 8, 0.05)
    # q_proj of layer 1 only: leaf names would over-select, so full HF paths are written.
    assert cfg["target_modules"] == [
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
    ]
    keys = set(load_file(str(tmp_path / "ad" / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys
    fresh = load_model(path)
    assert load_adapter(fresh, tmp_path / "ad") == list(lora_modules(model))
    ids = ids_batch()
    with torch.no_grad():
        assert torch.equal(fresh(ids), model(ids))


def test_load_adapter_errors(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints("qwen3")
    model = load_model(path)
    apply_lora(model, 4, 8, seed=0)
    good = save_adapter(model, tmp_path / "good")
    weights = load_file(str(good / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"

    def variant(name, tensors=None, **cfg_changes):
        d = tmp_path / name
        shutil.copytree(good, d)
        if tensors is not None:
            save_file(tensors, str(d / "adapter_model.safetensors"))
        cfg = json.loads((d / "adapter_config.json").read_text()) | cfg_changes
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        return d

    bad_shape = variant("shape", weights | {key: torch.zeros(128, 5)})
    with pytest.raises(GrpoError, match=r"lora_B.weight has shape \(128, 5\), expected \(128, 4\)"):
        load_adapter(load_model(path), bad_shape)
    unknown = variant("unknown", weights | {key.replace("up_proj", "w3"): torch.zeros(128, 4)})
    with pytest.raises(GrpoError, match="mlp.w3.lora_B.weight matches no LoRA layer"):
        load_adapter(load_model(path), unknown)
    missing = variant("missing", {k: v for k, v in weights.items() if k != key})
    with pytest.raises(GrpoError, match="missing 1 tensors, e.g. .*up_proj.lora_B.weight"):
        load_adapter(load_model(path), missing)
    other = load_model(path)
    apply_lora(other, 8, 8)
    with pytest.raises(GrpoError, match="has r=4, lora_alpha=8 but the model's LoRA at"):
        load_adapter(other, good)
    with pytest.raises(GrpoError, match="use_dora=True is not supported"):
        load_adapter(load_model(path), variant("dora", use_dora=True))
    with pytest.raises(GrpoError, match="no adapter_config.json"):
        load_adapter(load_model(path), tmp_path)


# ---------------------------------------------------------------- PEFT interop

# Qwen3 is tied, Llama untied; ALL_TARGETS adds lm_head.
INTEROP = [("qwen3", DEFAULT_TARGETS), ("llama", ALL_TARGETS), ("qwen3", ALL_TARGETS)]


@pytest.mark.parametrize("family,targets", INTEROP)
def test_peft_loads_our_adapter_and_merge_matches(tiny_checkpoints, tmp_path, family, targets):
    from peft import PeftModel

    src = tiny_checkpoints(family)
    model_dir = tmp_path / "base"
    shutil.copytree(src, model_dir)
    (model_dir / "tokenizer_config.json").write_text("{}")
    ours = load_model(model_dir)
    apply_lora(ours, 4, 16, targets=targets, seed=0)
    randomize_lora_b(ours)
    save_adapter(ours, tmp_path / "ad", base_model_name_or_path=str(model_dir))
    ids = ids_batch()
    peft_model = PeftModel.from_pretrained(hf_model(model_dir), str(tmp_path / "ad")).eval()
    with torch.no_grad():
        want = ours(ids)
        assert max_diff(peft_model(input_ids=ids).logits, want) <= 1e-5
        out = merge_command(model_dir, tmp_path / "ad", tmp_path / "merged")
        merged_logits = hf_model(out)(input_ids=ids).logits
        assert max_diff(merged_logits, want) <= 1e-5
        assert (out / "tokenizer_config.json").is_file()
        if family == "qwen3" and "lm_head" in targets:
            # PEFT merges a tied lm_head in place, which also moves the input embedding (its
            # logits then differ by O(1)); ours unties on merge, checked against `want` above.
            return
        peft_merged = peft_model.merge_and_unload()(input_ids=ids).logits
        assert max_diff(merged_logits, peft_merged) <= 1e-5


@pytest.mark.parametrize("family,targets", INTEROP)
def test_we_load_peft_adapter(tiny_checkpoints, tmp_path, family, targets):
    from peft import LoraConfig, get_peft_model

    path = tiny_checkpoints(family)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), task_type="CAUSAL_LM")
    torch.manual_seed(0)
    peft_model = get_peft_model(hf_model(path), cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(str(tmp_path / "ad"))
    ours = load_model(path)
    assert len(load_adapter(ours, tmp_path / "ad")) == 2 * 7 + ("lm_head" in targets)
    ids = ids_batch()
    with torch.no_grad():
        assert max_diff(ours(ids), peft_model.eval()(input_ids=ids).logits) <= 1e-5
