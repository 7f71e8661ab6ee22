"""peft's LoRA on a transformers 5.x MoE's 3-D expert banks and router, against the installed peft and transformers.

peft (utils/transformers_weight_conversion.py _convert_peft_config_moe) moves the 4.x expert and router names onto
the banks (LoraConfig.target_parameters, tuners/lora/layer.py ParamWrapper) for the model types whose transformers
conversion pattern is mixtral or qwen2_moe; ParamWrapper rebuilds each adapted bank as W + B A in every forward.
"""

import json

import pytest

from podkit.checks import activations as A
from podkit.checks.errors import ConfigError
from podkit.checks.memory import FOLDED_BANKS, _bank_folds, estimate, trainable_params

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

BASE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "num_experts_per_tok": 2, "max_position_embeddings": 512, "tie_word_embeddings": False}
# Tiny configs of each family, built locally (no Hub): DeepSeek-V3 with a dense first block and a shared expert.
TINY = {
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": 96,
                "num_local_experts": 8},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "intermediate_size": 128,
                  "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80, "num_experts": 8,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "intermediate_size": 128,
                  "moe_intermediate_size": 48, "num_experts": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "head_dim": 16},
    "olmoe": {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "intermediate_size": 48,
              "num_experts": 8, "eos_token_id": 1, "pad_token_id": 0},
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "intermediate_size": 128,
                    "moe_intermediate_size": 48, "n_routed_experts": 8, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1},
}


def _model_and_job(job, tmp_path, family, targets, dtype=None, checkpointing="none"):
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **TINY[family]}))
    j = job(model=f'hf_config = "{tmp_path / "config.json"}"',
            train=f"stack = 'hf'\ntransformers = '5.23.0'\nlora_rank = 4\nlora_targets = {json.dumps(targets)}\n"
                  f"checkpointing = '{checkpointing}'")
    config = AutoConfig.from_pretrained(tmp_path)
    if dtype is None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets)), j


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "down_proj"]])
def test_trainable_adapters_are_peft_s(job, tmp_path, family, targets):
    if family == "mixtral" and targets != "all-linear":
        targets = ["q_proj", "w2"]  # Mixtral's 4.x name for its experts' down projection
    model, j = _model_and_job(job, tmp_path, family, targets)
    adapted = {n for n, p in model.named_parameters() if p.requires_grad}
    # Every family but Qwen2-MoE (no pattern of its own in transformers 5.23's conversion table) has its banks adapted.
    assert any(".experts." in n for n in adapted) == (family != "qwen2_moe") == bool(j.facts.peft_banks)
    assert trainable_params(j) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_rebuilt_banks_are_what_autograd_keeps(job, tmp_path):
    # A real forward of the tiny Mixtral in bf16 with LoRA on everything: what autograd saves of (experts, ., .)
    # shape beyond parameters: per MoE layer the rebuilt gate_up and down banks, and the adapters baddbmm takes, cast to bf16
    # (peft keeps adapters in fp32). Without checkpointing all of it lives until backward.
    model, j = _model_and_job(job, tmp_path, "mixtral", "all-linear", dtype=torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if t.dim() == 3 and t.shape[0] == 8 and storage.data_ptr() not in params:  # (experts, ., .); batch is 2
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 1000, (2, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    assert j.facts.ac_policy == "none" and sum(saved.values()) == _bank_folds(j, "none")["fwd"]


def test_mixtral_8x7b_all_linear_by_hand(job):
    # Mixtral 8x7B on transformers 5, LoRA r16 on all-linear, bf16: each MoE layer's banks are 8 x 14336 x 4096 values
    # per unit (gate_up 2, down 1), and baddbmm keeps bf16 copies of the fp32 bank adapters:
    # gate_up A 256 x 4096 + B 28672 x 256, down A 128 x 14336 + B 4096 x 128 = 10,747,904 values.
    mixtral = 'preset = "mixtral-8x7b"'
    train = "stack = 'hf'\ntransformers = '5.0.0'\nlora_rank = 16\nlora_targets = 'all-linear'\nseq_len = 1024\n"
    unit, casts = 8 * 14336 * 4096 * 2, 10_747_904 * 2
    est = estimate(job(model=mixtral, train=train + "checkpointing = 'none'"))
    [kept] = [p.bytes for p in est.phase_parts["forward-end"] if p.label == FOLDED_BANKS]
    assert kept == 32 * (3 * unit + casts)  # every layer's, until its backward
    # Checkpointed: only the block in backward, its two banks and the gradient of one (4 units at most).
    est = estimate(job(model=mixtral, train=train + "checkpointing = 'full'"))
    [in_backward] = [p.bytes for p in est.phase_parts["backward"] if p.label == FOLDED_BANKS]
    assert in_backward == 4 * unit + casts
    # Forward-end's peak is the last block's own forward (no grad): its two rebuilt banks, nothing kept before it.
    assert [p.bytes for p in est.phase_parts["forward-end"] if p.label == FOLDED_BANKS] == [3 * unit + casts]


def test_half_a_fused_pair_is_refused(job):
    # peft adapts w1 and w3 together (fused into gate_up_proj) and raises for one alone.
    with pytest.raises(ConfigError, match="w1 and w3"):
        job(model='preset = "mixtral-8x7b"', train="stack = 'hf'\ntransformers = '5.0.0'\nlora_rank = 16\n"
            "lora_targets = ['q_proj', 'w1']")


@pytest.mark.parametrize("family, targets", [("deepseek_v3", ["mlp.gate_proj", "mlp.up_proj"]),
                                             ("deepseek_v3", ["q_proj", "mlp.down_proj"]),
                                             ("mixtral", ["q_proj", "experts.w1", "experts.w3"])])
def test_dotted_names_go_to_the_banks_as_peft_matches_them(job, tmp_path, family, targets):
    # peft maps a target equal to a 4.x name or ending in "." + it: DeepSeek's mlp.gate_proj moves to the routed bank
    # (and so leaves the dense block's mlp.gate_proj unadapted).
    model, j = _model_and_job(job, tmp_path, family, targets)
    assert j.facts.peft_banks
    assert trainable_params(j) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_a_dense_first_block_holds_no_rebuilt_bank(job, tmp_path):
    # DeepSeek's first_k_dense_replace blocks come first: the step's last backward (the first block's) has no bank.
    _, deepseek = _model_and_job(job, tmp_path, "deepseek_v3", "all-linear")
    assert _bank_folds(deepseek, "block")["end"] == 0 < _bank_folds(deepseek, "block")["bwd"]
    (tmp_path / "m").mkdir()
    _, mixtral = _model_and_job(job, tmp_path / "m", "mixtral", "all-linear")
    assert _bank_folds(mixtral, "block")["end"] == _bank_folds(mixtral, "block")["bwd"] > 0


def test_adapters_gathered_in_the_compute_dtype_are_not_copied(job):
    # Under FSDP's mixed precision the adapters reach ParamWrapper in bf16 already: baddbmm takes them as they are.
    j = job(model='preset = "mixtral-8x7b"', train="stack = 'hf'\ntransformers = '5.0.0'\nlora_rank = 16\n"
            "lora_targets = 'all-linear'\ncheckpointing = 'full'", cluster="gpus_per_node = 8\nsharding = 'zero3'")
    assert _bank_folds(j, "block")["bwd"] == 4 * 8 * 14336 * 4096 * 2


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_rebuilt_banks_alive_in_backward(job, tmp_path, checkpointing):
    # The tiny Mixtral in bf16 with LoRA on everything, forward and backward under a dispatch mode that follows every
    # (experts, ., .) tensor that is not a parameter until it is freed: the most alive at once in backward is the
    # estimate's "bwd" moment (a block's rebuilt banks, one bank's weight gradient, the adapters' casts, and without
    # checkpointing every other MoE layer's kept banks); with checkpointing the forward's most is one block's banks.
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    model, j = _model_and_job(job, tmp_path, "mixtral", "all-linear", dtype=torch.bfloat16, checkpointing=checkpointing)
    if checkpointing == "full":
        model.gradient_checkpointing_enable()  # transformers 5.23: use_reentrant=False
        model.enable_input_require_grads()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live, peak, phase = {}, {"forward": 0, "backward": 0}, ["forward"]

    def freed(key):
        live[key][0] -= 1
        if not live[key][0]:
            del live[key]

    class Banks(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == 8:
                    key = t.untyped_storage().data_ptr()
                    if key not in params:
                        live.setdefault(key, [0, t.untyped_storage().nbytes()])[0] += 1
                        weakref.finalize(t, freed, key)
            peak[phase[0]] = max(peak[phase[0]], sum(n for _, n in live.values()))
            return out

    ids = torch.randint(0, 1000, (2, 16))
    with Banks():
        loss = model(input_ids=ids, labels=ids).loss
        phase[0] = "backward"
        loss.backward()
    folds = _bank_folds(j, j.facts.ac_policy)
    assert peak["backward"] == folds["bwd"]
    assert peak["forward"] == (folds["fwd"] if checkpointing == "none" else folds["last"])


def test_kbit_prepared_banks_are_fp32_and_compute_in_fp32(job):
    # QLoRA of a transformers 5 MoE under TRL < 0.26 (bf16-mixed: prepare_model_for_kbit_training): bitsandbytes quantizes no
    # 3-D bank, and peft's prepare casts every parameter but Params4bit to fp32 (utils/other.py), so Qwen3-30B-A3B's
    # routed experts (48 layers x 128 experts x 3 x 768 x 2048) are held at 4 B each, and TRL casts back only the
    # embeddings and head. Their grouped matmuls then run in fp32 (transformers integrations/moe.py _grouped_mm:
    # input.to(weight.dtype)), so every routed row's activations are fp32 too.
    from podkit.checks.memory import frozen_groups

    j = job(model='preset = "qwen3-30b-a3b"', train="stack = 'hf'\ntransformers = '5.23.0'\nprecision = 'bf16-mixed'\n"
            "lora_rank = 16\nlora_targets = ['q_proj', 'v_proj']\nbase_quant = 'nf4'\ntrl = '0.25.1'")
    assert j.facts.kbit_prepared and not j.shape.expert_linears
    per = {g.name: p for g, p in frozen_groups(j)}
    banks = [g for g, _ in frozen_groups(j) if g.bank]
    assert sum(g.total for g in banks) == 48 * 128 * 3 * 768 * 2048 == j.shape.routed_params
    assert {per[g.name] for g in banks} == {4} and per["embed_tokens"] == per["lm_head"] == 2
    bf = A.block_facts(j)
    assert bf.bank_bytes == 4
    kept = A.saved_per_token(bf, "none", True)
    # gate and up outputs of the top 8 routed copies, 768 wide each, in fp32 (saved by silu and the product)
    assert kept["experts.gate_proj: output"] == kept["experts.up_proj: output"] == 8 * 768 * 4
    # Without k-bit preparation (a current TRL prepares nothing) the bf16 banks compute in bf16.
    plain = job(model='preset = "qwen3-30b-a3b"', train="stack = 'hf'\ntransformers = '5.23.0'\n"
                "precision = 'bf16-mixed'\nlora_rank = 16\nlora_targets = ['q_proj', 'v_proj']\nbase_quant = 'nf4'")
    assert A.block_facts(plain).bank_bytes == 2 and {p for g, p in frozen_groups(plain) if g.bank} == {2}
    # peft's rebuilt banks W + BA (ParamWrapper) are in W's dtype: fp32, and the fp32 adapters need no cast for it.
    folded = job(model='preset = "qwen3-30b-a3b"', train="stack = 'hf'\ntransformers = '5.23.0'\n"
                 "precision = 'bf16-mixed'\nlora_rank = 16\nlora_targets = 'all-linear'\nbase_quant = 'nf4'\n"
                 "checkpointing = 'none'\ntrl = '0.25.1'")
    assert _bank_folds(folded, "none")["fwd"] == 48 * 3 * (128 * 768 * 2048 * 4)
