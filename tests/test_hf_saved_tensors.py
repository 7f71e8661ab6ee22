"""The activation model (checks/activations.py) against what autograd saves in a real transformers 5.23 forward.

Tiny models built from config dicts (no Hub) run in pure bf16 on the CPU; saved_tensors_hooks records every tensor
autograd saves that is not a parameter, once per storage, under the module that saved it. Two sequence lengths and
their difference give bytes per token with per-step constants (LoRA's rebuilt expert banks, the experts' offsets)
cancelled. A block is taken at the last layer: the rotary cos/sin tables, shared by every layer, are first saved by
the first. podkit's side is saved_per_token and head_saved_per_token at the CPU's SDPA kernel, priced as
memory.estimate prices them (bytes per token x the sequence's tokens).
"""

import json
import re
import weakref

import pytest

from podkit.checks import activations as A
from podkit.checks import memory
from podkit.checks import stacks

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

BASE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "num_experts_per_tok": 2, "max_position_embeddings": 512, "tie_word_embeddings": False}
TINY = {  # the MoE ones as tests/test_lora_banks.py builds them
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "intermediate_size": 96},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "intermediate_size": 96, "head_dim": 16},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": 96,
                "num_local_experts": 8},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "intermediate_size": 128,
                  "moe_intermediate_size": 48, "num_experts": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "head_dim": 16},
    # use_cache off as the 5.23 Trainer sets it (trainer.py `self.model.config.use_cache = self.args.use_cache`,
    # TrainingArguments.use_cache False): with a DynamicCache, its torch.cat would copy v out of the fused qkv output.
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "intermediate_size": 96, "pad_token_id": 0,
             "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None, "use_cache": False},
    "gemma": {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "intermediate_size": 96, "head_dim": 16},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "intermediate_size": 96, "head_dim": 16,
               "final_logit_softcapping": None, "attn_logit_softcapping": None},
    "gemma3_text": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "intermediate_size": 96,
                    "head_dim": 16},
    # Multi-head latent attention (modeling_deepseek_v3.py DeepseekV3Attention): every head its own k and v
    # (num_key_value_heads = heads, as DeepSeek-V3's and V2-Lite's config.json), q through a 32-wide latent, the kv
    # latent 16 wide, q/k 16 + 8 RoPE wide and v 16. Layers 0 and 1 dense (first_k_dense_replace), layer 2 MoE.
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 3,
                    "num_key_value_heads": 4, "intermediate_size": 96, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 2,
                    "n_routed_experts": 8, "n_shared_experts": 1, "moe_intermediate_size": 32, "n_group": 1,
                    "topk_group": 1, "use_cache": False},
    # DeepSeek-V2-Lite's layout (modeling_deepseek_v2.py DeepseekV2Attention): no q latent, one q_proj; RoPE as
    # complex products of fp32 copies (apply_rotary_emb).
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "num_hidden_layers": 3,
                    "num_key_value_heads": 4, "intermediate_size": 96, "q_lora_rank": None, "kv_lora_rank": 16,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 2,
                    "n_routed_experts": 8, "n_shared_experts": 1, "moe_intermediate_size": 32, "use_cache": False},
    # GPT-OSS (modeling_gpt_oss.py): every block MoE, 8 experts of 32 with biases, a biased router, one sink per head;
    # layer 0 full attention, layer 1 sliding, its window beyond the sequences (no layer's mask differs).
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "head_dim": 16, "intermediate_size": 32,
                "num_local_experts": 8, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 512,
                "use_cache": False},
}
SEQS = (64, 128)
TOP_K = BASE["num_experts_per_tok"]
# What the 5.x MoE path saves beside the activations, per token, which podkit does not price (a few bytes against
# a real model's tens of KB per token and layer). transformers 5.23 integrations/moe.py grouped_mm_experts_forward:
# the gather index perm // top_k, the sort permutation perm (sample_weights[perm]), the sorted routing weights
# (the weighted product's), inv_perm (weighted_out[inv_perm]); int64 each but the weights. The router's topk keeps
# its int64 indices (TopkBackward0). Mixtral's router (modeling_mixtral.py MixtralTopKRouter) renormalises its fp32
# top values in place (`/= sum`: the sum and a copy of the values kept); Qwen3-MoE's (norm_topk_prob false) casts
# them to bf16.
# DeepSeek-V3's router (modeling_deepseek_v3.py DeepseekV3TopkRouter) picks its experts under no gradient (the group and
# expert top-k's indices die with that branch); what lives on is the gather of the chosen scores (its int64 index)
# and the in-place renormalisation `topk_weights /= denominator` (the fp32 denominator and a copy of the weights).
# GPT-OSS's router (modeling_gpt_oss.py GptOssTopKRouter) keeps topk's int64 indices; its softmax over the top values
# is priced. grouped_mm_experts_forward keeps the three int64 indices above and, where the expert biases train, a
# fourth: expert_ids_g, which gathers gate_up_proj_bias and down_proj_bias (one storage for both); the sorted routing
# weights are bf16 (the router's dtype).
ROUTING_BOOKKEEPING = {"mixtral": 8 * TOP_K + (4 + 4 * TOP_K) + 3 * 8 * TOP_K + 4 * TOP_K,
                       "qwen3_moe": 8 * TOP_K + 3 * 8 * TOP_K + 2 * TOP_K,
                       "deepseek_v3": 8 * TOP_K + (4 + 4 * TOP_K) + 3 * 8 * TOP_K + 4 * TOP_K,
                       "gpt_oss": 8 * TOP_K + 4 * 8 * TOP_K + 2 * TOP_K}
BIAS_INDEX = 8 * TOP_K  # GPT-OSS's expert_ids_g, kept only where the expert biases train (not under LoRA)


def _build(job, tmp_path, family, lora, attention, seq, batch=1):
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **TINY[family]}))
    train = (f"stack = 'hf'\ntransformers = '5.23.0'\nprecision = 'bf16'\ncheckpointing = 'none'\nseq_len = {seq}\n"
             f"attention = '{attention}'\nmicro_batch = {batch}\npadding = 'none'\n"
             + ("lora_rank = 4\nlora_targets = 'all-linear'\n" if lora else ""))
    j = job(model=f'hf_config = "{tmp_path / "config.json"}"', train=train)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), dtype=torch.bfloat16,
                                             attn_implementation=attention)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    return model.train(), j


class _Held:
    """A saved tensor as the graph holds it (a tensor's own Python object may die while the graph keeps the tensor)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _saved_storages(model, seq, batch=1) -> list[tuple[str, torch.Tensor]]:
    """What autograd saves in one forward (no labels: the loss is priced apart) and keeps for backward, once per
    storage, with the module that saved it first; parameters left out."""
    names = {m: n for n, m in model.named_modules()}
    stack = []
    pre = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: stack.append(names.get(m, "?")))

    def popped(module, args, output):
        stack.pop()  # and returns None: a hook's non-None return value replaces the module's output

    post = torch.nn.modules.module.register_module_forward_hook(popped)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []  # (weak reference to what the graph holds, module): a node that dies within the forward drops it

    def pack(t):
        held = _Held(t)
        saved.append((weakref.ref(held), stack[-1] if stack else ""))
        return held

    torch.manual_seed(1)
    ids = torch.randint(0, BASE["vocab_size"], (batch, seq))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
            out = model(input_ids=ids)
    finally:
        pre.remove()
        post.remove()
    # What is alive for backward. A branch of the graph the output does not reach (a router's top-k bookkeeping under
    # no gradient) is freed before the forward returns, and its storage may be reused by a later tensor: counted by
    # address while the tensors saved are alive.
    seen, kept = set(), []
    for ref, name in saved:
        held = ref()
        if held is None:
            continue
        ptr = held.tensor.untyped_storage().data_ptr()
        if ptr not in params | seen:
            seen.add(ptr)
            kept.append((name, held.tensor))
    del out
    return kept


def _saved_by_part(model, seq, batch=1) -> dict[str, int]:
    """Bytes saved for backward by part: "layerN", "head" (the final norm and lm_head) or the module's name."""
    parts = {}
    for name, t in _saved_storages(model, seq, batch):
        layer = re.search(r"layers\.(\d+)\.", name + ".")
        part = f"layer{layer.group(1)}" if layer else "head" if re.search(r"model\.norm$|lm_head$", name) else name
        parts[part] = parts.get(part, 0) + t.untyped_storage().nbytes()
    return parts


def _per_token(job, tmp_path, family, lora, attention="sdpa", layer=-1, batch=1):
    """(podkit, measured) bytes per token for a block (the last, or `layer`: not the first, which saves the rotary
    tables every layer shares) and for the head, from the two sequence lengths."""
    bytes_at = {}
    for seq in SEQS:
        model, j = _build(job, tmp_path, family, lora, attention, seq, batch)
        bf = A.block_facts(j, device="cpu")
        assert j.facts.ac_policy == "none"
        index = layer % j.shape.layers
        moe = j.shape.moe is not None and index >= j.shape.moe.dense_layers
        block = sum(A.saved_per_token(bf, "none", moe).values())
        head = sum(A.head_saved_per_token(bf, not j.facts.lora, j.facts.quantize_head).values())
        parts = _saved_by_part(model, seq, batch)
        bytes_at[seq] = (block * seq * batch, head * seq * batch, parts[f"layer{index}"], parts["head"])
    lo, hi = SEQS
    return [(bytes_at[hi][i] - bytes_at[lo][i]) / (hi - lo) / batch for i in range(4)]


@pytest.mark.parametrize("lora", [False, True])
def test_dense_block_saves_what_podkit_prices(job, tmp_path, lora):
    # Exact under eager attention: every saved tensor of the block and of the head is one podkit prices.
    podkit_block, podkit_head, block, head = _per_token(job, tmp_path, "llama", lora, "eager")
    assert (podkit_block, podkit_head) == (block, head)


# An unpadded batch under SDPA: transformers >= 4.54 (PR #39412; 5.23 integrations/sdpa_attention.py use_gqa_in_sdpa)
# passes grouped-query k/v unrepeated with enable_gqa=True when there is no mask, and an unpadded batch's causal mask
# is skipped (masking_utils.py _ignore_causal_mask_sdpa); a batch of one is unpadded (train.padding "stack").
# tests/test_attention_mask.py checks the padded path.
@pytest.mark.parametrize("lora", [False, True])
def test_unpadded_sdpa_takes_kv_unrepeated(job, tmp_path, lora):
    podkit_block, podkit_head, block, head = _per_token(job, tmp_path, "llama", lora, "sdpa")
    assert (podkit_block, podkit_head) == (block, head)


@pytest.mark.parametrize("family, lora", [("mixtral", False), ("mixtral", True)])
def test_moe_block_saves_what_podkit_prices_and_the_routing_indices(job, tmp_path, family, lora):
    # The 5.x experts run grouped_mm over every routed row (top_k per token, exactly), so the activations match
    # exactly; the routing's indices and weights (ROUTING_BOOKKEEPING) are all that podkit leaves out.
    podkit_block, podkit_head, block, head = _per_token(job, tmp_path, family, lora, "eager")
    assert block - podkit_block == ROUTING_BOOKKEEPING[family]
    assert podkit_head == head


@pytest.mark.parametrize("family, lora", [("qwen3", False), ("qwen3", True), ("qwen3_moe", False)])
def test_qk_norm_is_priced(job, tmp_path, family, lora):
    # Qwen3's per-head q_norm and k_norm (transformers 5.23 modeling_qwen3.py Qwen3Attention:
    # self.q_norm(self.q_proj(x).view(..., head_dim)), the block's RMSNorm) save an fp32 upcast, an fp32 rsqrt per
    # head and (for the weight's gradient) the bf16 cast back, of q and of k: 4 x 64 + 4 x 4 + 2 x 64 + 4 x 32 +
    # 4 x 2 + 2 x 32 = 600 B per token and block here, which podkit once left out (7520 measured vs 6920).
    podkit_block, podkit_head, block, head = _per_token(job, tmp_path, family, lora, "eager")
    assert block - podkit_block == ROUTING_BOOKKEEPING.get(family, 0) and podkit_head == head


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3_text"])
@pytest.mark.parametrize("lora", [False, True])
def test_gemma_norms_are_priced(job, tmp_path, family, lora):
    # GemmaRMSNorm (transformers 5.23 modeling_gemma*.py) scales by (1 + weight) in fp32 and casts after: where the
    # weight trains it saves the fp32 normalised x (4 B) for the weight's gradient, not LlamaRMSNorm's 16-bit cast
    # (+128 B per token and norm here). Gemma 2 and 3 also norm the attention's and the MLP's outputs before each
    # residual add (post_attention_layernorm, post_feedforward_layernorm): two more norms per block, each saving its
    # fp32 input and rsqrt (2 x (4 x 64 + 4) = 520 B per token with LoRA). podkit once priced a Llama block for them
    # (gemma2: 6920 against 8208 measured, 8120 against 8640 with LoRA). The sliding window (4096) is beyond the
    # sequences, so no layer here takes a mask.
    podkit_block, podkit_head, block, head = _per_token(job, tmp_path, family, lora, "eager")
    assert (podkit_block, podkit_head) == (block, head)


@pytest.mark.parametrize("lora, attention", [(False, "eager"), (True, "eager"), (True, "sdpa"), (False, "sdpa")])
def test_phi3_fused_projections_are_priced(job, tmp_path, lora, attention):
    # Phi3Attention and Phi3MLP (transformers 5.23 modeling_phi3.py) run one qkv_proj and one gate_up_proj and slice
    # them: LoRA on all-linear adapts each once (its fp32 input copy, 256 B per token here, and its lora_A output),
    # and under SDPA without a k/v repeat the saved v, a view, keeps the whole qkv output. podkit once priced three
    # and two linears named q/k/v_proj and gate/up_proj, which all-linear's qkv_proj and gate_up_proj never matched:
    # 6760 against 7304 measured (eager, LoRA), 2168 against 2904 (SDPA, LoRA). Phi3's RoPE builds q with torch.cat, so
    # q is (b, heads, s, d)-contiguous and a flash kernel's output, allocated like q, is copied back for o_proj, whose
    # weight trains in a full fine-tune and keeps that copy (2392 against 2520, SDPA, full).
    j = job(model='preset = "phi-3-mini"', train="stack = 'hf'")
    assert j.facts.fused_proj and "fused_proj" in [x.split(":")[0] for x in stacks.left_out(j.train, j.cluster, j.facts)]
    podkit_block, podkit_head, block, head = _per_token(job, tmp_path, "phi3", lora, attention)
    assert (podkit_block, podkit_head) == (block, head)


def test_phi3_fused_projections_are_the_transformers_models_alone(job):
    """Review 2026-11-26: only a transformers model runs Phi-3's qkv_proj and gate_up_proj fused. torchtune splits both
    on load (models/phi3/_convert_weights.py phi3_hf_to_tune), litgpt splits gate_up_proj into fc_1/fc_2
    (scripts/convert_hf_checkpoint.py copy_weights_phi; its qkv is its own fused one, Stack.fused_qkv), podkit's model
    and bin/smoke's replica build five linears. podkit priced the fused views for every stack but the replica, and
    resolved LoRA targets against the fused names everywhere: torchtune's default q_proj and v_proj matched nothing,
    and the replica of any Phi-3 LoRA job (bin/smoke, preflight --traced) stopped on a ValueError, its targets
    naming qkv_proj and gate_up_proj, which its model does not have."""
    from podkit.train.step import model_options

    phi3, lora = 'preset = "phi-3-mini"', "lora_rank = 8\nprecision = 'bf16'\n"
    split = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for stack, fused in (("hf", True), ("deepspeed", True), ("podkit", False), ("torchtune", False)):
        j = job(model=phi3, train=f"stack = '{stack}'\n{lora}lora_targets = 'all-linear'")
        assert j.facts.fused_proj == fused, stack
        assert set(j.facts.lora_targets) == ({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if fused else split)
        replica = j.as_replica()
        assert not replica.facts.fused_proj and set(model_options(replica).lora_targets) == split, stack
        # the replica's prediction walks the adapters its model runs: one on each of the five linears
        adapted = {k.split(":")[0] for k in A.saved_per_token(A.block_facts(replica, "cpu"), "none")
                   if "lora_A output" in k}
        assert adapted == split, (stack, adapted)
    # ... and the adapters' weights it trains (memory.trainable_groups), by hand for Phi-3 mini (hidden 3072, q, k and v
    # 3072 wide each, ffn 8192, 32 layers, r 8): split, q, k, v are three A (3072 x 8) and three B (8 x 3072), and gate,
    # up two A (3072 x 8) and two B (8 x 8192), against fused qkv_proj's one A and one B (8 x 9216) and gate_up_proj's
    # one A and one B (8 x 16384); o_proj and down_proj alike.
    from podkit.checks.memory import trainable_groups

    j = job(model=phi3, train=f"stack = 'hf'\n{lora}lora_targets = 'all-linear'")
    fused, split_total = (sum(g.total for g in trainable_groups(x)) for x in (j, j.as_replica()))
    h, q, ffn, r = 3072, 3072, 8192, 8
    assert split_total - fused == 32 * ((3 * (h * r + r * q) - (h * r + r * 3 * q))
                                        + (2 * (h * r + r * ffn) - (h * r + r * 2 * ffn)))
    tune = job(model=phi3, train=f"stack = 'torchtune'\n{lora}")  # its recipes' q, v, output and MLP targets
    assert set(tune.facts.lora_targets) == {"q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    hf = job(model=phi3, train=f"stack = 'hf'\n{lora}lora_targets = ['qkv_proj']")
    assert model_options(hf.as_replica()).lora_targets == ("q_proj", "k_proj", "v_proj")


@pytest.mark.parametrize("family", ["llama", "gemma", "gemma2", "gemma3_text"])
def test_the_replicas_gemma_block_saves_what_podkit_prices(job, tmp_path, family, lora=False):
    """bin/smoke's replica builds Gemma's norms and Gemma 2/3's sandwich norms too (train/model.py RMSNorm `gemma`,
    Block `sandwich`): its last block saves per token what podkit prices for the same job, a full fine-tune (where
    the norms' weights train). (With the podkit stack's LoRA the replica's CPU block saves 64 B per token more than
    priced here, Llama's too: not these norms.)"""
    from podkit.train import model as model_mod
    from podkit.train.step import model_options

    from tests.saved_bytes import saved_under

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **TINY[family]}))
    per_seq = {}
    for seq in SEQS:
        j = job(model=f'hf_config = "{tmp_path / "config.json"}"',
                train=f"precision = 'bf16'\ncheckpointing = 'none'\nseq_len = {seq}\nattention = 'sdpa'\n"
                      + ("lora_rank = 4\n" if lora else ""))
        torch.manual_seed(0)
        model = model_mod.materialize(model_mod.build(j.shape, model_options(j), "bf16"), torch.device("cpu"), 0)
        ids = torch.randint(0, BASE["vocab_size"], (1, seq))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = saved_under(model.layers[-1], params, lambda: model(ids, ids))
        per_seq[seq] = (saved, sum(A.saved_per_token(A.block_facts(j, "cpu"), "none").values()) * seq)
    (lo_real, lo_podkit), (hi_real, hi_podkit) = per_seq[SEQS[0]], per_seq[SEQS[1]]
    assert hi_real - lo_real == hi_podkit - lo_podkit


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("lora", [False, True])
def test_latent_attention_is_priced(job, tmp_path, lora, family):
    # DeepseekV3Attention (transformers 5.23 modeling_deepseek_v3.py): the q latent and its RMSNorm, the kv latent's
    # RMSNorm over a slice of kv_a_proj_with_mqa's output (its fp32 upcast a copy of that slice), kv_b_proj up to every
    # head's key and value; q and k are new (b, heads, s, 24) tensors, and eager's probs @ v keeps v as a view of
    # kv_b_proj's whole output (a batch of one row). podkit once priced a Llama block of 4 heads of 24 (7176 against
    # 7568 measured, full; 6680 against 7584 with LoRA, whose adapters sit on the five latent projections).
    # DeepseekV2's apply_rotary_emb multiplies complex views of fp32 copies of q's and the shared key's RoPE parts by
    # freqs_cis, which no gradient reaches: it keeps only that table, shared by every layer, like V3's cos and sin.
    podkit_block, podkit_head, block, head = _per_token(job, tmp_path, family, lora, "eager", layer=1)
    assert (podkit_block, podkit_head) == (block, head)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_latent_attention_under_sdpa_on_the_cpu(job, tmp_path, family, batch):
    # q and k 24 wide, v 16: no CPU flash kernel (sdp_utils_cpp.cpp check_head_dim_size_cpp) but the math one, which
    # casts bf16 q, k and v to fp32 first (torch 2.5+ attention.cpp _scaled_dot_product_attention_math): it keeps fp32
    # q, k, v and attention weights, which podkit once priced in bf16 (1920 B per token short, 2048 for two rows).
    podkit_block, podkit_head, block, head = _per_token(job, tmp_path, family, False, "sdpa", layer=1, batch=batch)
    assert (podkit_block, podkit_head) == (block, head)


def test_latent_attention_copies_v_for_a_batch(job, tmp_path):
    # torch.matmul(probs, v) reshapes v to (b x heads, s, 16), which cannot view a strided split of kv_b_proj's output
    # once b > 1: the kept v is a heads x v_head_dim copy (4 x 16 x 2 B per token), and kv_b_proj's output (4 x 32 x
    # 2 B) dies with the forward (BlockFacts.mla_value "copy"; a batch of one keeps the view).
    podkit_block, podkit_head, block, head = _per_token(job, tmp_path, "deepseek_v3", False, "eager", layer=1, batch=2)
    assert (podkit_block, podkit_head) == (block, head)
    one = _per_token(job, tmp_path, "deepseek_v3", False, "eager", layer=1)
    assert one[2] - block == 4 * 16 * 2


@pytest.mark.parametrize("lora", [False, True])
def test_deepseek_moe_router_scores_in_fp32(job, tmp_path, lora):
    # DeepseekV3TopkRouter: F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32)). Its weight
    # trains in a full fine-tune, and peft adapts it under all-linear: either way the linear keeps the fp32 copy of
    # the hidden states, 4 x 64 B per token here, which podkit once left out (and the routing's bookkeeping).
    j = job(model='preset = "deepseek-v2-lite"', train="stack = 'hf'\nattention = 'eager'")
    assert A.block_facts(j).router_fp32
    assert not A.block_facts(job(model='preset = "deepseek-v2-lite"', train="stack = 'torchtitan'")).router_fp32
    podkit_block, podkit_head, block, head = _per_token(job, tmp_path, "deepseek_v3", lora, "eager")
    assert block - podkit_block == ROUTING_BOOKKEEPING["deepseek_v3"] and podkit_head == head
    # The router weight's own fp32 copy (experts x hidden), kept by the same matmul for the input's gradient: one per
    # MoE layer and step, whatever the tokens (memory._router_casts).
    model, j = _build(job, tmp_path, "deepseek_v3", lora, "eager", SEQS[1])  # 128 tokens: not the (64, 8) copy
    copies = [t for name, t in _saved_storages(model, SEQS[1])
              if re.search(r"\.mlp\.gate\b", name) and t.dtype == torch.float32 and t.shape == (64, 8)]
    assert len(copies) == 1 and copies[0].untyped_storage().nbytes() == 8 * 64 * 4
    assert memory._router_casts(j, "none")["fwd"] == j.shape.moe_layers * 8 * 64 * 4


@pytest.mark.parametrize("precision, lora_quant", [("bf16-mixed", ""), ("bf16-mixed", "nf4"), ("fp32", "")])
def test_deepseek_router_weight_casts_by_precision(job, tmp_path, precision, lora_quant):
    # The router's F.linear keeps its weight's cast for the input's gradient. Under autocast F.linear casts the weight
    # to bf16, and that copy is kept: an fp32 master's (autocast's cached cast) and the frozen fp32 weight of a base
    # prepared for k-bit training (peft utils/other.py prepare_model_for_kbit_training casts every parameter but
    # Params4bit to fp32; its 4-bit linears change nothing here, so the base stays unquantized) alike. An fp32 weight
    # without autocast is used as it is. podkit once priced none for the first two and an fp32 copy for the third.
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **TINY["deepseek_v3"]}))
    train = f"stack = 'hf'\ntransformers = '5.23.0'\nprecision = '{precision}'\ncheckpointing = 'none'\n"
    if lora_quant:
        train += f"lora_rank = 4\nlora_targets = ['q_a_proj']\nbase_quant = '{lora_quant}'\ntrl = '0.25.1'\n"
    j = job(model=f'hf_config = "{tmp_path / "config.json"}"', train=train)
    assert (j.facts.autocast, j.facts.kbit_prepared) == (precision != "fp32", bool(lora_quant))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), attn_implementation="eager",
                                             dtype=torch.bfloat16 if lora_quant else torch.float32)
    if lora_quant:
        model = peft.get_peft_model(peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False),
                                    peft.LoraConfig(r=4, target_modules=["q_a_proj"]))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=j.facts.autocast):
        saved = _saved_storages(model.train(), SEQS[1])  # 128 tokens: no activation is (64, 8)
    kept = sum(t.untyped_storage().nbytes() for name, t in saved
               if re.search(r"\.mlp\.gate\b", name) and t.shape == (64, 8))
    priced = memory._router_casts(j, "none").get("fwd", 0)
    assert priced == j.shape.moe_layers * kept
    assert kept == (8 * 64 * 2 if j.facts.autocast else 0)
    # Its scores, `router_logits.sigmoid()` kept for backward, are in the logits' dtype: bf16 under autocast.
    scores = [t for name, t in saved if re.search(r"\.mlp\.gate\b", name) and t.shape == (SEQS[1], 8)]
    per_token = A.saved_per_token(A.block_facts(j, "cpu"), "none", True)["router scores (softmax or sigmoid)"]
    assert [t.untyped_storage().nbytes() for t in scores] == [per_token * SEQS[1]]
    assert per_token == 8 * (2 if j.facts.autocast else 4)


@pytest.mark.parametrize("lora", [False, True])
def test_gpt_oss_block_is_priced(job, tmp_path, lora):
    # GptOssDecoderLayer (transformers 5.23 modeling_gpt_oss.py) under eager attention: GptOssRMSNorm keeps the fp32
    # normalised x for its weight's gradient (as GemmaRMSNorm); RoPE's torch.cat makes q and k anew; the softmax over
    # the scores and each head's sink column is kept in bf16, s + 1 wide, beside the row max's int64 indices (one per
    # head); the router keeps its softmax over the top 2 only; each routed row keeps gate_up's whole output (the clamps'
    # strided inputs), the clamped gate, sigmoid's output, glu and up + 1 (and with the experts trained, their inputs).
    # podkit once refused the model_type; read but walked as a Mixtral block (Llama norms, an fp32 s x s softmax and its
    # cast, silu(gate) * up, fp32 scores of all 8 experts) it priced 7208 B per token against 4872 measured (full),
    # 7272 against 4664 (LoRA on q, k, v, o), and the head 516 against 644 (full).
    podkit_block, podkit_head, block, head = _per_token(job, tmp_path, "gpt_oss", lora, "eager")
    assert block - podkit_block == ROUTING_BOOKKEEPING["gpt_oss"] - (BIAS_INDEX if lora else 0)
    assert podkit_head == head


def test_gpt_oss_sink_softmax_under_autocast(job, tmp_path):
    # fp32 masters under CPU autocast (bf16-mixed): torch.cat promotes the bf16 scores to the fp32 sinks' dtype, so the
    # softmax of the scores and the sink column is kept in fp32, and `.to(value_states.dtype)` makes the bf16 copy of
    # the sliced weights that probs @ v keeps; with q, the repeated k and v and the row max's int64 indices, the
    # attention module's saved tensors are exactly what podkit prices (5040 B per token here). (The experts'
    # grouped_mm runs on the fp32 bank weights under autocast, which podkit's 5.x MoE walk prices in bf16.)
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **TINY["gpt_oss"]}))
    kept = {}
    for seq in SEQS:
        j = job(model=f'hf_config = "{tmp_path / "config.json"}"',
                train=f"stack = 'hf'\nprecision = 'bf16-mixed'\ncheckpointing = 'none'\nseq_len = {seq}\n"
                      "attention = 'eager'")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), dtype=torch.float32,
                                                 attn_implementation="eager").train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            saved = _saved_storages(model, seq)
        measured = sum(t.untyped_storage().nbytes() for name, t in saved if re.search(r"layers\.1\.self_attn$", name))
        priced = A.saved_per_token(A.block_facts(j, "cpu"), "none", True)
        attention = ("q after RoPE", "k repeated to every head", "v repeated to every head",
                     "row max indices of the scores and sink (int64)")
        kept[seq] = (measured, seq * sum(v for k, v in priced.items() if k.endswith("(s x s)") or k in attention))
    (lo_real, lo_podkit), (hi_real, hi_podkit) = kept[SEQS[0]], kept[SEQS[1]]
    assert hi_real - lo_real == hi_podkit - lo_podkit == 5040 * (SEQS[1] - SEQS[0])


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_banks_run_in_fp32_under_autocast(job, tmp_path, family):
    # fp32 masters under CPU autocast (bf16-mixed, a full fine-tune): transformers 5.x's experts call _grouped_mm, which
    # is not autocast-enabled and runs `input.to(weight.dtype)` (integrations/moe.py): on fp32 banks the gathered
    # tokens, gate, up, their product and the down output are all fp32, where autocast's nn.Linear layers would be
    # bf16. podkit once priced them in bf16 (1492 B per token short on a tiny GPT-OSS, found in its review).
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **TINY[family]}))
    per_seq = {}
    for seq in SEQS:
        j = job(model=f'hf_config = "{tmp_path / "config.json"}"',
                train=f"stack = 'hf'\nprecision = 'bf16-mixed'\ncheckpointing = 'none'\nseq_len = {seq}\n"
                      "attention = 'eager'")
        assert j.facts.autocast and A.block_facts(j, "cpu").bank_bytes == 4
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), dtype=torch.float32,
                                                 attn_implementation="eager").train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            saved = _saved_storages(model, seq)
        measured = sum(t.untyped_storage().nbytes() for name, t in saved if ".layers.1." in name + ".")
        per_seq[seq] = (measured, seq * sum(A.saved_per_token(A.block_facts(j, "cpu"), "none", True).values()))
    (lo_real, lo_podkit), (hi_real, hi_podkit) = per_seq[SEQS[0]], per_seq[SEQS[1]]
    assert (hi_real - lo_real) - (hi_podkit - lo_podkit) == ROUTING_BOOKKEEPING[family] * (SEQS[1] - SEQS[0])
